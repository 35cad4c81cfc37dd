"""The engine side: code that runs inside an inference engine's process (SGLang, vLLM, your own). The
clients (`Client`, `AsyncClient`) that talk to the daemon over its Unix socket and copy page bytes through
the shared pool, engine memory regions (`shared_buffer`, region registration), and the engine adapters
built on them, one subpackage each (`sglang`: SGLang's HiCache storage backend; `vllm`: a secondary tier of
vLLM's KV offloading). It imports nothing from the daemon side: only `hicached.common`."""
