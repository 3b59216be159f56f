"""The device cache's decode on one H200 against one line (ms per token = fixed + host x miss rate
+ per upload x uploads per token, least squares over the measured cache rows), and what the
planner would buy with a larger margin: the shipped default replayed on the live trace recorded
there with its planner pricing uploads at slower links, through that line (MODELLED). The inputs
and the fit: moecache.offline.gpu_calibration.

    python scripts/fit_gpu_decode.py        (a few seconds; imports moecache as found)
"""

import sys

from moecache.formats.traces import TRACES_DIR, read_trace
from moecache.offline.gpu_calibration import H200_RATES, H200_ROWS, H200_STOCK_TOK_S, fit, planned_at
from moecache.util import OneLineParser

LINKS_GBPS = (H200_RATES.link_gbps, 5.3, 2.5, 1.3)
SLOTS = (8, 16, 32, 64)
TRACE = "synth-qwen3-30b-a3b.h200-k16.route.csv"


def main() -> None:
    line, residuals = fit()
    stock_ms = 1000 / H200_STOCK_TOK_S
    print(f"MEASURED rows, fitted: ms per token = {line.fixed_ms:.2f} + {line.host_ms:.2f} x miss rate + "
          f"{line.per_upload_ms:.3f} x uploads per token (stock {stock_ms:.2f} ms)")
    print("| config | measured ms | fitted ms | residual |")
    print("|---|---:|---:|---:|")
    for row, residual in zip(H200_ROWS, residuals):
        print(f"| {row.config} | {row.ms:.2f} | {line.ms(row.hit_rate, row.uploads_per_token):.2f} | {100 * residual:+.1f}% |")
    trace = read_trace(str(TRACES_DIR / TRACE))
    print(f"\nMODELLED: the default replayed on {TRACE}, its planner pricing uploads at each link "
          f"rate (the machine's measured {H200_RATES.link_gbps} GB/s first), through the line")
    print("| planned link GB/s | K | hit % | uploads/token | ms/token | vs stock |")
    print("|---:|---:|---:|---:|---:|---:|")
    for link in LINKS_GBPS:
        for slots in SLOTS:
            hit, uploads = planned_at(trace, slots, link)
            ms = line.ms(hit, uploads)
            print(f"| {link:g} | {slots} | {100 * hit:.1f} | {uploads:.1f} | {ms:.2f} | {stock_ms / ms:.2f}x |")


if __name__ == "__main__":
    sys.exit(OneLineParser(prog="fit_gpu_decode.py", description=__doc__.split("\n\n")[0]).run(lambda _: main()))
