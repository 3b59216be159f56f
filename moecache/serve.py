"""`python -m moecache.serve`: llama_cpp.server with the cache (moecache.live.serve)."""

from .live.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
