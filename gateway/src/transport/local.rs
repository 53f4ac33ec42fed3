//! The engine in this process: `swarmgate serve`. Every agent runs on it.

use engine::{EngineHandle, EventStream, GenerateRequest, ModelInfo};
use futures::future::BoxFuture;

use super::Transport;

pub struct Local {
    engine: EngineHandle,
}

impl Local {
    pub fn new(engine: EngineHandle) -> Self {
        Self { engine }
    }
}

impl Transport for Local {
    fn model(&self) -> &ModelInfo {
        self.engine.model()
    }

    fn models(&self) -> &[ModelInfo] {
        self.engine.models()
    }

    fn submit<'a>(
        &'a self,
        _agent: Option<&'a str>,
        request: GenerateRequest,
    ) -> BoxFuture<'a, engine::Result<EventStream>> {
        Box::pin(std::future::ready(self.engine.submit(request)))
    }

    fn serves(&self, _agent: &str) -> bool {
        true
    }

    fn is_ready(&self) -> bool {
        self.engine.is_running()
    }

    fn local_engine(&self) -> Option<&EngineHandle> {
        Some(&self.engine)
    }
}
