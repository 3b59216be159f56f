"""The policy core, shared by the live cache and the offline replay: the engine (slots, the
publication delay, the per-step bookkeeping in C), the policies, admission, usage profiles, the
route-trace format and the bank arithmetic. It imports neither wing (tests/test_layout.py)."""
