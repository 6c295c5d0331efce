"""Engine adapters (transformers, sglang, vllm), installed as `agentstate.adapters`.

Each adapter converts an engine's native KV layout to and from canonical KV. They are imported
lazily by name, so `import agentstate` never pulls in an engine.
"""
