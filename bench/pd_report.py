"""What `pd_compare.py` prints and keeps: tables against the baseline, connector hook and read-phase
lines, and rounds summarized as median [min, max] ratios with a verdict (`--summarize`)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path


def ratio(a: float, b: float) -> str:
    if not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}x"


def print_tables(results: dict[str, dict], baseline: str = "native") -> None:
    base = results.get(baseline, {})
    print("\n== throughput (router, streaming) ==")
    print(f"{'system':<18}{'C':>4}{'tok/s':>10}{'vs ' + baseline[:8]:>11}{'TTFT p50':>10}{'p95':>9}{'TPOT p50':>10}{'failed':>8}")
    for name, r in results.items():
        for key in sorted(k for k in r if k.startswith("throughput_c")):
            t = r[key]
            b = base.get(key, {})
            print(f"{name:<18}{key[12:]:>4}{t['output_tok_s']:>10.0f}{ratio(t['output_tok_s'], b.get('output_tok_s', 0)):>11}"
                  f"{t['ttft_p50_ms']:>10.1f}{t['ttft_p95_ms']:>9.1f}{t['tpot_p50_ms']:>10.2f}{t['failed']:>8}")
    for scenario, label in (("cold", "cold arrivals during background decode"),
                            ("revisit", "revisit after eviction (hot documents, cycles 2+)"),
                            ("churn", "changing working set (no revisits)")):
        rows = [(name, r[scenario]) for name, r in results.items() if scenario in r]
        if not rows:
            continue
        ref = next((r for n, r in rows if n == baseline), rows[0][1])
        print(f"\n== {label} ==")
        print(f"{'system':<18}{'TTFT p50':>10}{'p95':>9}{'mean':>9}{'p50 vs ' + baseline[:8]:>15}{'failed':>8}")
        for name, r in rows:
            print(f"{name:<18}{r['ttft_p50_ms']:>10.1f}{r['ttft_p95_ms']:>9.1f}{r['ttft_mean_ms']:>9.1f}"
                  f"{ratio(r['ttft_p50_ms'], ref['ttft_p50_ms']):>15}{r['failed']:>8}")
    rows = [(name, key, r[key]) for name, r in results.items() for key in sorted(
        (k for k in r if k.startswith("openloop_r")), key=lambda k: float(k[10:]))]
    if rows:
        slo = rows[0][2]
        print(f"\n== open loop (Poisson arrivals; goodput: TTFT <= {slo['slo_ttft_ms']:g} ms and "
              f"TPOT <= {slo['slo_tpot_ms']:g} ms) ==")
        print(f"{'system':<18}{'req/s':>6}{'n':>5}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}"
              f"{'p99':>8}{'in SLO':>8}{'goodput':>9}{'tok/s':>8}{'lag p99':>9}{'failed':>7}")
        for name, key, r in rows:
            print(f"{name:<18}{r['rate_rps']:>6g}{r['requests']:>5}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>9.1f}"
                  f"{r['tpot_p50_ms']:>10.2f}{r['tpot_p99_ms']:>8.2f}{r['itl_p50_ms']:>9.2f}{r['itl_p99_ms']:>8.2f}"
                  f"{r.get('slo_attainment', float('nan')):>8.1%}"
                  f"{r['goodput_rps']:>9.2f}{r['output_tok_s']:>8.0f}{r['send_lag_p99_ms']:>9.1f}{r['failed']:>7}")
        for name, r in results.items():
            g = r.get("openloop_goodput")
            if g:
                bound = "" if g["reached"] else " (not reached in the sweep: a lower bound)"
                print(f"{name}: goodput {g['rate_rps']:.1f} req/s, the highest rate with {g['attainment']:.0%} of "
                      f"requests in SLO{bound}")
    rows = [(name, r[key]) for name, r in results.items() for key in sorted(
        (k for k in r if k.startswith("vllmbench_r")), key=lambda k: float(k[11:]))]
    if rows:
        print("\n== open loop, vLLM's `vllm bench serve` (random dataset) ==")
        print(f"{'system':<18}{'req/s':>6}{'done':>6}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}"
              f"{'goodput':>9}{'tok/s':>8}{'failed':>7}")
        for name, r in rows:
            print(f"{name:<18}{r.get('request_rate', 0):>6g}{r.get('completed', 0):>6}{r.get('p50_ttft_ms') or 0:>10.1f}"
                  f"{r.get('p99_ttft_ms') or 0:>9.1f}{r.get('p50_tpot_ms') or 0:>10.2f}{r.get('p99_tpot_ms') or 0:>8.2f}"
                  f"{r.get('request_goodput') or 0:>9.2f}{r.get('output_throughput') or 0:>8.0f}{r.get('failed') or 0:>7}")
        print("the same run with vLLM's CLI: " + rows[0][1].get("command", ""))
    rows = [(name, r["revisitload"]) for name, r in results.items() if "revisitload" in r]
    if rows:
        ref = next((r for n, r in rows if n == baseline), rows[0][1])
        print("\n== revisit under load (hot documents, cycles 2+, while closed-loop clients run) ==")
        print(f"{'system':<22}{'TTFT p50':>9}{'p95':>8}{'vs ' + baseline[:8]:>12}{'first':>8}{'load tok/s':>11}"
              f"{'load TTFT':>10}{'restore_copy p50':>17}{'n':>5}{'restores':>9}{'ms each':>8}{'busy drops':>11}"
              f"{'failed':>7}")
        for name, r in rows:
            h = r.get("p", {})
            print(f"{name:<22}{r['ttft_p50_ms']:>9.1f}{r['ttft_p95_ms']:>8.1f}"
                  f"{ratio(r['ttft_p50_ms'], ref['ttft_p50_ms']):>12}{r['first_visit']['ttft_p50_ms']:>8.1f}"
                  f"{r['load'].get('output_tok_s', float('nan')):>11.0f}{r['load']['ttft_p50_ms']:>10.1f}"
                  f"{h.get('restore_copy_p50_ms', float('nan')):>17.2f}{h.get('restore_copy_count', 0):>5}"
                  f"{h.get('restores', 0):>9}{h.get('restore_ms_each', float('nan')):>8.2f}"
                  f"{h.get('busy_writer_dropped', 0):>11}{r['failed']:>7}"
                  + ("" if r.get("load_outlasted_revisits", True) else "  (the load ended before the revisits)"))


def goodput_rate(result: dict, attainment: float) -> dict:
    """DistServe's goodput over one system's open-loop rates: the highest rate at which at least
    `attainment` of the requests met both SLOs, interpolated linearly between the last rate that
    met it and the first that did not. `reached` is False when every rate met it (the sweep did
    not find the system's limit: the figure is a lower bound) or none did."""

    rows = sorted(((v["rate_rps"], v.get("slo_attainment", float("nan"))) for k, v in result.items()
                   if k.startswith("openloop_r") and isinstance(v, dict)), key=lambda row: row[0])
    out = {"attainment": attainment, "rates": [rate for rate, _ in rows]}
    last = -1  # the last rate of the unbroken run of passing rates from the lowest
    while last + 1 < len(rows) and rows[last + 1][1] >= attainment:
        last += 1
    if last < 0:  # even the lowest rate missed: goodput is below the sweep
        out.update(rate_rps=0.0, reached=bool(rows))
        return out
    if last + 1 == len(rows):
        out.update(rate_rps=rows[last][0], reached=False)
        return out
    (low, got_low), (high, got_high) = rows[last], rows[last + 1]
    share = (got_low - attainment) / (got_low - got_high) if got_low > got_high else 0.0
    out.update(rate_rps=low + share * (high - low), reached=True)
    return out


def print_hooks(results: dict[str, dict]) -> None:
    rows = [(name, scenario, side, figures) for name, r in results.items()
            for key in ("hooks", "hooks_load")
            for scenario, sides in (r.get(key) or {}).items() for side, figures in sorted(sides.items())]
    if not rows:
        return
    print("\n== connector hooks inside the engines (bench/hook_timing.py) ==")
    print(f"{'system':<16}{'scenario':<12}{'engine side':<36}{'step p50':>9}{'p90':>7}{'reqs/step':>10}"
          f"{'tok/step':>9}{'hooks us/step':>14}  biggest hooks (us/step)")
    for name, scenario, side, f in rows:
        top = sorted(f["hooks"].items(), key=lambda kv: -kv[1]["us_per_step"])[:3]
        step = f["step"]
        print(f"{name:<16}{scenario:<12}{side:<36}{step.get('p50_ms', float('nan')):>9.2f}"
              f"{step.get('p90_ms', float('nan')):>7.2f}{f.get('requests_per_step', 0):>10.1f}"
              f"{f.get('tokens_per_step', 0):>9.0f}"
              f"{f['hook_us_per_step']:>14.0f}  " + ", ".join(f"{k} {v['us_per_step']:.0f}" for k, v in top))


def print_timings(results: dict) -> None:
    from ..core.timings import format_timings

    for name, r in results.items():
        for key in ("timings", "timings_capped"):
            found = r.get(key)
            if found and "phases" in found:
                print(f"\n== {name}: phases from the event logs ({'capped' if key.endswith('capped') else 'open'} "
                      f"run; kvbaton timings) ==\n" + format_timings(found))
        for key in ("sidecars", "sidecars_capped"):
            run = "capped" if key.endswith("capped") else "open"
            io = (((r.get(key) or {}).get("prefill") or {}).get("history") or {}).get("io")
            if io:
                print(f"{name} P's history copies ({run} run): " + history_io_line(io))
            transfer = ((r.get(key) or {}).get("decode") or {}).get("transfer") or {}
            if transfer.get("phased_reads"):
                print(f"{name} D's reads ({run} run): " + read_phases_line(transfer))


def read_phases_line(transfer: dict) -> str:
    """Where D's reads spent their time, per read, from its sidecar's books."""

    from kvbaton.control.messages import READ_PHASES

    reads = transfer["phased_reads"]
    line = f"{reads} reads, per read: " + ", ".join(
        f"{phase} {transfer.get(f'{phase}_seconds', 0.0) / reads * 1e3:.2f} ms" for phase in READ_PHASES)
    posted = transfer.get("reads", 0)
    good = posted - transfer.get("failed", 0)
    if good > 0:  # bytes count the good reads; descriptors only the reads described here
        line += (f"; {transfer.get('bytes', 0) / good / 1e6:.1f} MB and "
                 f"{transfer.get('descriptors', 0) / good:.0f} descriptors per good read, "
                 f"{transfer.get('landed', 0)} of {posted} landed")
        # The copy began no earlier than transfer() was called and was seen done `seen_done`
        # after that, which bounds its rate from below (nothing bounds it from above: it may
        # have started late). settle_busy, the last check that still saw a read in flight, is
        # averaged over every read, 0 for those never seen in flight, so it is no bound: shown
        # as it is. Zero-byte reads have no phases, so bytes / phased reads.
        nbytes = transfer.get("bytes", 0) / reads
        seen_done = (transfer.get("transfer_call_seconds", 0.0) + transfer.get("settle_seconds", 0.0)) / reads
        if seen_done > 0 and nbytes:
            line += (f"; seen done {seen_done * 1e3:.2f} ms after transfer() was called "
                     f"(at least {nbytes / seen_done / 1e9:.1f} GB/s)")
    return line


def history_io_line(io: dict) -> str:
    """P's history copies from its sidecar's books: per stage, demotion batch and restore."""

    def each(count: int, seconds: float, nbytes: int = 0) -> str:
        if not count:
            return "none"
        rate = f", {nbytes / seconds / 1e9:.1f} GB/s" if nbytes and seconds else ""
        return f"{count} x {seconds / count * 1e3:.2f} ms{rate}"

    batches = io.get("demote_batches", 0)
    # Issuing is the copier thread's time before its fence (CUDA calls, run bookkeeping); the
    # fence is the wait for the GPU. Under 7B load the issuing was most of a batch.
    issue_s = io.get("demote_seconds", 0.0) - io.get("demote_fence_seconds", 0.0)
    fence = (f" (issue {max(0.0, issue_s) / batches * 1e3:.2f} ms, "
             f"fence {io.get('demote_fence_seconds', 0.0) / batches * 1e3:.2f} ms, "
             f"{io.get('demote_paired_runs', 0) / max(1, io.get('demote_copied_batches', 0)):.1f} "
             f"slot runs per batch that copied, "
             f"{io.get('demote_gathered_batches', 0)} gathered)") if batches else ""
    return (f"stages {each(io.get('stages', 0), io.get('stage_seconds', 0.0), io.get('stage_bytes', 0))}; "
            f"demotion batches {each(batches, io.get('demote_seconds', 0.0))}{fence}, "
            f"{io.get('demotions', 0)} blocks; "
            f"restores {each(io.get('restores', 0), io.get('restore_seconds', 0.0), io.get('restore_bytes', 0))}")


def round_ratios(rounds: list[dict[str, dict]], baseline: str = "native") -> dict[str, dict[str, list[float]]]:
    """Per system and figure, each round's ratio to `baseline` in that round: output tok/s for
    throughput, TTFT P50 for cold, revisit and churn (round_summary has every figure)."""

    ratios: dict[str, dict[str, list[float]]] = {}
    for results in rounds:
        base = results.get(baseline, {})
        for name, r in results.items():
            if name == baseline:
                continue
            for key, value in r.items():
                figure = ("output_tok_s" if key.startswith("throughput_c") else
                          "ttft_p50_ms" if key in ("cold", "revisit", "churn") else "")
                other = base.get(key)
                if not figure or not isinstance(value, dict) or not isinstance(other, dict):
                    continue  # start_s, error, sidecars, ... or a figure native lacks
                mine, theirs = value.get(figure), other.get(figure)
                if mine and theirs:
                    ratios.setdefault(name, {}).setdefault(key, []).append(mine / theirs)
    return ratios


# Each scenario's figures in the rounds' summary: (result key, figure path, True when higher is
# better, None for a count that gets no verdict).
SUMMARY_FIGURES = {
    "throughput_c": [("output_tok_s", True), ("ttft_p50_ms", False), ("tpot_p50_ms", False), ("t2_p50_ms", False)],
    "cold": [("ttft_p50_ms", False), ("t2_p50_ms", False)],
    "revisit": [("ttft_p50_ms", False), ("ttft_p95_ms", False)],
    "churn": [("ttft_p50_ms", False)],
    "agent": [("ttft_p50_ms", False), ("ttft_p95_ms", False), ("first_turn.ttft_p50_ms", False),
              ("traffic.output_tok_s", True), ("traffic.ttft_p50_ms", False)],
    "openloop_goodput": [("rate_rps", True)],
    "vllmbench_r": [("p50_ttft_ms", False), ("p99_ttft_ms", False), ("p50_tpot_ms", False),
                    ("request_goodput", True), ("output_throughput", True)],
    "openloop_r": [("slo_attainment", True), ("ttft_p50_ms", False), ("ttft_p99_ms", False), ("t2_p50_ms", False), ("tpot_p50_ms", False), ("tpot_p99_ms", False),
                   ("itl_p50_ms", False), ("itl_p99_ms", False), ("goodput_rps", True), ("output_tok_s", True)],
    "revisitload": [("ttft_p50_ms", False), ("ttft_p95_ms", False), ("first_visit.ttft_p50_ms", False),
                    ("load.output_tok_s", True), ("load.ttft_p50_ms", False), ("load.tpot_p50_ms", False),
                    ("p.restore_copy_p50_ms", False), ("p.restore_copy_count", None), ("p.restores", None),
                    ("p.restore_ms_each", False), ("p.busy_writer_dropped", None)],
}


def _figures(result: dict) -> dict[str, tuple[float, bool | None]]:
    """One system's figures in one round, flattened: {"revisitload.ttft_p50_ms": (value, higher_better)}."""

    out = {}
    for key, value in result.items():
        if not isinstance(value, dict):
            continue
        group = next((g for g in SUMMARY_FIGURES if key == g or (g.endswith(("_c", "_r")) and key.startswith(g)
                                                                    and key[len(g):].replace(".", "").isdigit())),
                     None)
        if group is None:
            continue
        for path, higher in SUMMARY_FIGURES[group]:
            found = value
            for part in path.split("."):
                found = found.get(part) if isinstance(found, dict) else None
            if isinstance(found, (int, float)) and not (isinstance(found, float) and math.isnan(found)):
                out[f"{key}.{path}"] = (float(found), higher)
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def relative_spread(values: list[float]) -> float:
    """Half the [min, max] range over the median: how far one system's own rounds stray, the
    noise floor a ratio against it must clear (0 with one round)."""

    middle = statistics.median(values)
    return (max(values) - min(values)) / 2 / middle if len(values) > 1 and middle else 0.0


def ratio_verdict(r: dict, higher: bool | None, noise: float = 0.0) -> str:
    """"parity" when the rounds' [min, max] of the ratio covers 1.0 or the median's distance from
    1.0 is inside the A/A noise (the larger relative spread of the two systems' own rounds, or of
    an A/A duplicate's ratio); else better/worse by that distance (one round gets no verdict)."""

    if higher is None:
        return ""
    if r["n"] < 2:
        return "one round"
    if r["min"] <= 1.0 <= r["max"] or abs(r["median"] - 1.0) <= noise:
        return "parity"
    gain = (r["median"] - 1.0) if higher else (1.0 - r["median"])
    return f"{'better' if gain > 0 else 'worse'} by {abs(gain) * 100:.1f}%"


def round_summary(rounds: list[dict[str, dict]], baseline: str) -> dict:
    """Per system and figure: the value's median/min/max over the rounds, and the ratio to
    `baseline` (each round's own baseline) likewise, with its verdict."""

    values: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, dict[str, list[float]]] = {}
    direction: dict[str, bool | None] = {}
    for results in rounds:
        base = _figures(results.get(baseline, {}))
        for name, r in results.items():
            for figure, (value, higher) in _figures(r).items():
                direction[figure] = higher
                values.setdefault(name, {}).setdefault(figure, []).append(value)
                if name != baseline and figure in base and base[figure][0]:
                    ratios.setdefault(name, {}).setdefault(figure, []).append(value / base[figure][0])
    # A/A: a duplicate "X-b" against X in the same round, where the run has one.
    aa: dict[str, dict[str, list[float]]] = {}
    for results in rounds:
        for name, r in results.items():
            original = results.get(name[:-2]) if name.endswith("-b") else None
            if original is None:
                continue
            mine, theirs = _figures(r), _figures(original)
            for figure, (value, _) in mine.items():
                if figure in theirs and theirs[figure][0]:
                    aa.setdefault(name[:-2], {}).setdefault(figure, []).append(value / theirs[figure][0])
    out: dict = {"baseline": baseline, "rounds": len(rounds), "systems": {}}
    base_values = values.get(baseline, {})
    for name, figures in values.items():
        rows = out["systems"].setdefault(name, {})
        for figure, found in figures.items():
            row = {"value": spread(found), "aa_spread": relative_spread(found)}
            if aa.get(name, {}).get(figure):
                row["aa_ratio"] = spread(aa[name][figure])
            if found_ratios := ratios.get(name, {}).get(figure):
                noise = max(row["aa_spread"], relative_spread(base_values.get(figure, [1.0])),
                            *(abs(x - 1.0) for x in aa.get(name, {}).get(figure, [])),
                            *(abs(x - 1.0) for x in aa.get(baseline, {}).get(figure, [])))
                row["ratio"] = spread(found_ratios)
                row["ratio"]["noise"] = noise
                row["ratio"]["verdict"] = ratio_verdict(row["ratio"], direction[figure], noise)
            rows[figure] = row
    return out


def print_round_summary(summary: dict) -> None:
    print(f"\n== {summary['rounds']} rounds: median [min, max] per figure, and the ratio to "
          f"{summary['baseline']} (each round's own), 'parity' where the ratio's [min, max] covers 1.0 ==")
    print("A/A: each system's own rounds' half range over their median (and an X-b duplicate's ratio to X "
          "where run); a ratio inside the larger noise of the two systems is parity")
    print(f"{'system':<22}{'figure':<38}{'median [min, max]':>30}{'A/A':>8}{'ratio median [min, max]':>30}"
          f"{'noise':>8}  verdict")
    for name, figures in summary["systems"].items():
        for figure, row in figures.items():
            v = row["value"]
            text = f"{v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]"
            r = row.get("ratio")
            rtext = f"{r['median']:.3f}x [{r['min']:.3f}, {r['max']:.3f}]" if r else "-"
            noise = f"{r['noise']:.1%}" if r else ""
            print(f"{name:<22}{figure:<38}{text:>30}{row.get('aa_spread', 0.0):>8.1%}{rtext:>30}{noise:>8}  "
                  f"{r['verdict'] if r else ''}")


def summarize_files(paths: list[str], baseline: str, out: str = "") -> int:
    """The rounds of several result files as one run's: one summary over all of them."""

    rounds, metas = [], []
    for path in paths:
        found = json.loads(Path(path).read_text())
        rounds += found.get("rounds") or [found["results"]]
        metas.append({"file": path, "commit": found.get("meta", {}).get("commit", ""),
                      "rounds": len(found.get("rounds") or [1])})
    names = [name for r in rounds for name in r]
    if baseline not in names:
        baseline = names[0]
    summary = round_summary(rounds, baseline)
    print_round_summary(summary)
    if out:
        Path(out).write_text(json.dumps({"files": metas, "summary": summary}, indent=1))
    return 0
