"""The offline wing: replaying recorded routing traces through the core's engine (replay), the
global-budget and upstream-llama.cpp cache models, and the modelled cost. No libllama here: it
imports the core only (tests/test_layout.py)."""
