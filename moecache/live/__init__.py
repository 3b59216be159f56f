"""The live wing: the cache in a running llama.cpp process. Attaching (activate: probe the model,
plan the cache, allocate it once, then the live cache on it), the live cache and its decode-step
boundary and reports, its configuration, sizing and placement, libllama's and ggml's APIs, the
loopback RPC device, run.py's CLI and the server entry. It drives the core's engine; the offline
wing never imports it."""
