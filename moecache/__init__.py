"""moecache: a per-layer GPU cache of MoE experts for llama.cpp."""
