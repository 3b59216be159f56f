"""The file formats: routing traces (moecache.formats.traces: the CSV, its writer and its binary
form) and usage profiles (moecache.formats.profile). The engine reads none of them; the live
wing writes them and the offline wing replays them."""
