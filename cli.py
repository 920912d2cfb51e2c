"""The `kvbaton` command: serve, demo, replay, timings, fuzz, bench."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path


def _event_subjects(event) -> set[str]:
    names = {"ticket", "request", "lease", "key", "read"}
    return {str(getattr(event, f)) for f in event.__struct_fields__ if f in names}


def _short(struct) -> str:
    fields = ", ".join(f"{f}={getattr(struct, f)!r}" for f in struct.__struct_fields__ if f != "at_ns")
    return f"{type(struct).__name__}({fields})"


def stream_log(path: str) -> tuple:
    """A log read lazily from a memory map: its header (checked), its records one at a time
    (memory bounded by the largest record, not the file), and a close(). Raises LogError or
    OSError with a readable message."""

    import mmap
    import os

    from .core.log import MAGIC, LogError, checked_records, read_header

    stream = open(path, "rb")
    try:
        size = os.fstat(stream.fileno()).st_size
        data = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except BaseException:
        stream.close()
        raise
    try:
        header, offset = read_header(data)
        problems = header.config.problems()
        if problems:
            raise LogError(len(MAGIC), "header config is invalid: " + "; ".join(problems))
    except BaseException:
        close_quietly(data, stream)
        raise
    return header, checked_records(data, offset), lambda: close_quietly(data, stream)


def close_quietly(data, stream) -> None:
    try:
        if hasattr(data, "close"):
            data.close()
    except BufferError:  # a record's view still alive: the map goes with the process
        pass
    stream.close()


def event_logs(command: str, given: list[str]) -> list[Path] | None:
    """The event logs named: files as given, folders as every *.kvlog under them; None (after a
    line on stderr) when a folder holds none."""

    paths: list[Path] = []
    for name in given:
        path = Path(name)
        if path.is_dir():
            found = sorted(path.rglob("*.kvlog"))
            if not found:
                print(f"kvbaton {command}: {path}: no *.kvlog event log under this folder", file=sys.stderr)
                return None
            paths.extend(found)
        else:
            paths.append(path)
    return paths


def cmd_replay(args) -> int:
    if args.diagram:
        from .core import history, lease, load, ticket

        for spec in (ticket.SPEC, load.SPEC, lease.SPEC, history.SPEC):
            print(f"%% {spec.name}")
            print(spec.mermaid())
        if not args.log:
            return 0
    if not args.log:
        print("kvbaton replay: give a log path (or --diagram)", file=sys.stderr)
        return 2
    paths = event_logs("replay", args.log)
    if paths is None:
        return 2
    paths = [str(path) for path in paths]
    codes = []
    for index, path in enumerate(paths):
        if len(paths) > 1 and not args.json:
            print(("\n" if index else "") + f"== {path}")
        codes.append(_replay_one(args, path))
    broken, unreadable = codes.count(1), codes.count(2)
    if len(paths) > 1 and not args.json:
        print(f"\n{len(paths)} logs replayed: " + (", ".join(
            part for part in (f"{broken} broke an invariant" if broken else "",
                              f"{unreadable} could not be read" if unreadable else "") if part) or "all clean"))
    # A broken invariant is what an operator must see first; then an unreadable log.
    return 1 if broken else (2 if unreadable else 0)


def _replay_one(args, log: str) -> int:
    """Replay one log: 0 clean, 1 an invariant broke or the state diverged, 2 unreadable."""

    import msgspec

    from .core.log import LogError
    from .core.replay import replay

    try:
        header, records, close = stream_log(log)
    except (LogError, OSError, ValueError) as exc:
        print(f"kvbaton replay: {log}: {exc}", file=sys.stderr)
        return 2
    wanted = {x for x in (args.request, args.ticket) if x}
    encoder = msgspec.json.Encoder()
    shown = 0

    def show(step) -> None:
        nonlocal shown
        if step.event is None:
            if args.json or step.diverged:
                pass
            else:
                return
        if wanted and (step.event is None or not (_event_subjects(step.event) & wanted)
                       and not any(_event_subjects(e) & wanted for e in step.effects)):
            if not step.violations:
                return
        shown += 1
        if args.json:
            print(encoder.encode({
                "seq": step.seq,
                "event": None if step.event is None else {"type": type(step.event).__name__,
                                                          **msgspec.structs.asdict(step.event)},
                "effects": [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in step.effects],
                "violations": step.violations,
                "diverged": step.diverged,
            }).decode())
            return
        if step.event is None:
            print(f"{step.seq:>7}  checkpoint  {step.diverged}")
            return
        at_ms = step.event.at_ns / 1e6
        print(f"{step.seq:>7}  {at_ms:>12.3f} ms  {_short(step.event)}")
        for effect in step.effects:
            print(f"{'':>26}-> {_short(effect)}")
        for violation in step.violations:
            print(f"{'':>26}!! {violation}")
        if step.diverged:
            print(f"{'':>26}!! state hash diverged: {step.diverged}")

    quiet = args.quiet
    position = {"seq": 0}

    def counted(source):
        for record in source:
            position["seq"] = record.seq
            if record.seq > args.max_records:
                raise LogError(0, f"more than {args.max_records} records (--max-records)")
            yield record

    def run(source, **kw):
        try:
            return replay(header, counted(source), check_every=args.check_every, **kw)
        except (LogError, ValueError, OverflowError, TypeError) as exc:
            # A hostile or damaged log: one line, never a traceback from inside the core.
            where = "" if isinstance(exc, LogError) else f"record {position['seq']}: "
            print(f"kvbaton replay: {log}: {where}{exc}", file=sys.stderr)
            return None
        finally:
            close()

    result = run(records, on_step=None if quiet else show)
    if result is None:
        return 2
    if result.first_violation is not None and args.check_every > 1:
        # Checks ran every --check-every events: find the exact first broken event by replaying
        # again up to where the first check failed, checking every event after the last clean one.
        try:
            _header, records, close = stream_log(log)
        except (LogError, OSError, ValueError) as exc:
            print(f"kvbaton replay: {log}: {exc}", file=sys.stderr)
            return 2
        seen_at = result.first_violation.seq
        if seen_at > 0:
            records = itertools.takewhile(lambda record: record.seq <= seen_at, records)
        exact = run(records, exact_after=result.last_clean_seq)
        if exact is None:
            return 2
        result = msgspec.structs.replace(result, first_violation=exact.first_violation or result.first_violation)
    if not args.json:
        print(f"log: {log} (engine {header.engine or '?'}, role {header.role or '?'}, "
              f"writer {header.writer}, schema {header.schema})")
    first = result.first_violation
    if first is not None:
        print(f"first violation at event {first.seq}: {_short(first.event) if first.event else 'checkpoint'}")
        for text in first.violations[:10]:
            print(f"  {text}")
    if result.first_divergence is not None:
        print(f"first divergence at record {result.first_divergence.seq}: {result.first_divergence.diverged}")
    violations = result.violating_events + (1 if result.first_divergence is not None else 0)
    print(f"replay: {result.events} events, state {result.state_hash}, {violations} violations")
    return 1 if violations else 0


def cmd_fuzz(args) -> int:
    if args.shell or args.broken:
        return cmd_fuzz_shell(args)
    from .sim.fuzz import run_fuzz

    progress = None
    bar = None
    if sys.stderr.isatty() and not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.sequences, unit="seq", file=sys.stderr)
            progress = bar.update
        except ImportError:
            bar = None
    report = run_fuzz(seed=args.seed, sequences=args.sequences, steps=args.steps, out=args.out,
                      progress=progress)
    if bar is not None:
        bar.close()
    print("faults exercised:")
    for name, count in sorted(report.faults.items()):
        print(f"  {name:<28} {count}")
    print("transitions exercised ((state, trigger) pairs; moves are (state, trigger, dest)):")
    for machine, cov in report.coverage.items():
        unreachable = f", {cov.unreachable} unreachable (sim/coverage.py)" if cov.unreachable else ""
        print(f"  {machine:<14} {cov.exercised}/{cov.declared} pairs{unreachable}; "
              f"{cov.moves_exercised}/{cov.moves_declared} moves")
        if cov.missing:
            print(f"    never exercised: {', '.join(cov.missing)}")
    for failure in report.failures:
        print(f"FAILED seed {failure['seed']} on {failure['node']}: {failure['first'][0]}")
        if "log" in failure:
            print(f"  shrunk log ({failure['events']} events): {failure['log']}")
            print(f"  inspect: kvbaton replay {failure['log']}")
    print(f"fuzz: {report.sequences} sequences, {report.events} events, "
          f"{report.violations} violations, {report.leaks} leaks")
    return 1 if (report.violations or report.leaks) else 0


def cmd_fuzz_shell(args) -> int:
    """The sidecars' own shell code on a virtual clock and a simulated network (sim/shell.py)."""

    try:
        from .sim.shell import run_shell_fuzz

        import vllm.v1.request  # noqa: F401 - the decode engines run the connector's scheduler side
    except ImportError as exc:
        print(f"kvbaton fuzz --shell runs the sidecar and the connector's scheduler side, which need "
              f"the control plane's packages and vLLM (pip install 'kvbaton[cpu,nixl,serve]'): {exc}",
              file=sys.stderr)
        return 2
    report = run_shell_fuzz(seed=args.seed, sequences=args.sequences, broken=args.broken or "")
    print("faults exercised:")
    for name, count in sorted(report["faults"].items()):
        print(f"  {name:<28} {count}")
    print("rare paths reached:")
    for name, count in sorted(report["outcomes"].items()):
        print(f"  {name:<28} {count}")
    for failure in report["failures"]:
        print(f"FAILED sequence {failure['index']} (kvbaton fuzz --shell --seed {args.seed} "
              f"--sequences {failure['index'] + 1}{' --break ' + args.broken if args.broken else ''} reproduces it):")
        for line in failure["first"]:
            print(f"  {line}")
    shell = f"the shell broken as {args.broken}" if args.broken else "the sidecar's shell"
    print(f"fuzz ({shell}): {report['sequences']} sequences, {report['events']} events, "
          f"{report['violations']} failing")
    return 1 if report["violations"] else 0


def cmd_bench(args) -> int:
    import runpy

    scripts = {"core": "core_apply.py"}
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "bench", scripts[args.which])
    if not os.path.exists(path):
        print(f"kvbaton bench: {path} is not installed with this copy (run it from a checkout)",
              file=sys.stderr)
        return 2
    runpy.run_path(path, run_name="__main__")
    return 0


def cmd_demo(args) -> int:
    from .control.client import keep_xoscar_light

    keep_xoscar_light()  # this process runs the router and never needs torch (engines are children)
    from .deploy.demo import run_demo

    return run_demo(args)


def cmd_serve(args) -> int:
    from .control.client import keep_xoscar_light

    keep_xoscar_light()  # as for the demo: the engines run in child processes
    from .deploy.serve import run_serve

    return run_serve(args)


def cmd_router_key(args) -> int:
    from .control.guard import SecretError, resolve_secret
    from .control.router_door import router_key

    if not args.secret_file and not os.environ.get("KVBATON_SECRET"):
        # Never from a per-user secret made on the spot: that key would match no engine.
        print("kvbaton router-key: name the deployment secret (--secret-file, or KVBATON_SECRET)", file=sys.stderr)
        return 2
    try:
        print(router_key(resolve_secret(args.secret_file or "", "127.0.0.1")).hex())
    except SecretError as exc:
        print(f"kvbaton router-key: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_timings(args) -> int:
    from .core.log import LogError, read_log_prefix
    from .core.timings import engine_stream, format_story, format_timings, request_story, timings

    paths = event_logs("timings", args.logs)
    if paths is None:
        return 2
    logs = []
    for path in paths:
        try:
            header, records, stopped = read_log_prefix(str(path))
        except (LogError, OSError) as exc:
            print(f"kvbaton timings: {path}: {exc}", file=sys.stderr)
            return 2
        if stopped is not None:  # a live engine's log ends mid-record: time what is there
            print(f"kvbaton timings: {path}: read {len(records)} records, then {stopped}", file=sys.stderr)
        logs.append((header.engine, *engine_stream(header, records)))
    if args.request:
        story = request_story(logs, args.request)
        print(json.dumps(story, indent=1) if args.json else format_story(story))
        return 0 if story["events"] else 1
    result = timings([log[1:] for log in logs], slowest=args.slowest)
    result["logs"] = [str(p) for p in paths]
    print(json.dumps(result, indent=1) if args.json else format_timings(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbaton", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("replay", help="re-run an engine's event log and check every invariant")
    p.add_argument("log", nargs="*", help="event logs, or folders holding them (each replayed in turn)")
    p.add_argument("--request", help="show only events about this request")
    p.add_argument("--ticket", help="show only events about this ticket")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.add_argument("--diagram", action="store_true", help="print each machine as a mermaid diagram")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    p.add_argument("--check-every", type=int, default=64, metavar="N",
                   help="check every invariant after every N events (and the exact first broken "
                        "event in a second pass when one fails); 1: after every event (default 64: "
                        "replay time stays linear in a log's records)")
    p.add_argument("--max-records", type=int, default=50_000_000,
                   help="refuse a log with more records than this (default 50 million)")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("timings", help="where handoffs, retentions and restores spent their time "
                                       "(phase latencies from event logs)")
    p.add_argument("logs", nargs="+", help="event logs, or folders holding them (a P and a D of one "
                                           "host also join across the handoff)")
    p.add_argument("--request", help="one request's story instead (P's or D's request id; the other "
                                     "side joins by ticket): each event, what came of it, how its load "
                                     "or restore ended")
    p.add_argument("--slowest", type=int, default=5, metavar="N",
                   help="also the N loads that ended last after P issued their ticket, each split into "
                        "its phases (default 5; 0: none)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_timings)

    p = sub.add_parser("fuzz", help="seeded swarm simulation of P/D lifecycles with injected faults")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sequences", type=int, default=2000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="fuzz-failures", help="where shrunk failing logs go")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--shell", action="store_true",
                   help="run the sidecars' own code (stamping, effects, claim retries, heartbeats) on a "
                        "virtual clock and a simulated network instead of the core's model of it")
    p.add_argument("--break", dest="broken", choices=("dropped_release", "endless_claim_retry", "lost_finished_recving",
                                                       "unpinned_reads", "unsynced_reads"),
                   help="with --shell: a deliberately broken shell the run must catch (exit 1)")
    p.set_defaults(func=cmd_fuzz)

    p = sub.add_parser("bench", help="micro-benchmarks (core)")
    p.add_argument("which", choices=["core"])
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="start P and D on the built-in tiny model and run a workload")
    p.add_argument("--log-dir", default="runs/demo")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="start P and D engines and the router")
    from .deploy.serve import add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("router-key", help="print the router's key to the sidecars' router door, derived from "
                                          "the deployment secret (for `kvbaton serve --router-key-file` on "
                                          "a host that must not hold the secret)")
    p.add_argument("--secret-file", default=None, help="the deployment secret (default: $KVBATON_SECRET, "
                                                       "else this user's per-host secret)")
    p.set_defaults(func=cmd_router_key)
    return parser


def main(argv: list[str] | None = None) -> int:
    import signal

    if hasattr(signal, "SIGPIPE"):  # `kvbaton replay LOG | head` should just stop
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
