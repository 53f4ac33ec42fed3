//! Swarmgate's agents and routing: agent definitions, the registry, the routing agent, placement
//! of agents on devices, and the verifier. Uses the engine; knows nothing of HTTP.
