"""`python -m moecache.replay`: the offline trace replay (moecache.offline.cli)."""

from .offline.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
