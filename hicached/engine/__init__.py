"""The engine side: code that runs inside an inference engine's process (SGLang, vLLM, your own). The
clients (`Client`, `AsyncClient`) that talk to the daemon over its Unix socket and copy page bytes through
the shared pool, engine memory regions (`shared_buffer`, region registration), and the engine
integrations built on them (`sglang`: SGLang's HiCache storage backend). It imports nothing from the
daemon side: only `hicached.common`."""
