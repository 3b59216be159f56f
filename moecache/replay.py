"""`python -m moecache.replay`: the offline trace replay (moecache.offline.replay)."""

from .offline.replay import main

if __name__ == "__main__":
    raise SystemExit(main())
