//! The `llm` strategy (next).
pub struct LlmRouter;
