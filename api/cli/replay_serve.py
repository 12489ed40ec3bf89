"""`stepline replay LOG --serve`: the dashboard (api/http/dashboard/) over a recorded run.

The page and `GET /v1/events` are served as by `stepline serve`, from the file: the stream
is the run's events from its first, and then nothing more; the page folds them and moves
through the run with a step scrubber. A log of several runs needs `--run`. No API key: it
listens on 127.0.0.1 unless `--host` says otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from stepline.events.log import read_runs
from stepline.events.replay import resolve_run


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`--serve` and where it listens."""
    p.add_argument(
        "--serve",
        action="store_true",
        help="open the dashboard on the log (a run of it: --run) at http://HOST:PORT/dashboard/ "
        "with a step scrubber, until Ctrl-C",
    )
    p.add_argument("--host", default="127.0.0.1", help="with --serve: the address (127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=8001, help="with --serve: the port (8001; 0: any free one)"
    )


def serve_log(args: argparse.Namespace, out: TextIO) -> int:
    """Serve the dashboard on `args.log` until a stop; returns the exit code (1: cannot
    listen). Raises what reading the log's runs raises (replay turns it into exit 2)."""
    import anyio
    import uvicorn

    from stepline.api.http.events import replay_app
    from stepline.api.http.serve import base_url, bind_socket
    from stepline.events.feed import EventFeed

    index = resolve_run(args.log, args.run, needed=True)
    run = next(r for r in read_runs(args.log) if r.index == index)
    feed = EventFeed(run.header, log_path=args.log, live=False, run=index)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(
            f"stepline replay: cannot listen on {args.host}:{args.port}: "
            f"{exc.strerror or exc} (choose another --port)",
            file=sys.stderr,
        )
        return 1
    url = base_url(args.host, sock.getsockname()[1])
    shown = f"{args.log} ({run.name})"
    print(f"stepline replay: the dashboard of {shown} at {url}/dashboard/", file=out)
    print("stepline replay: Ctrl-C stops it", file=out, flush=True)
    config = uvicorn.Config(replay_app(feed), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    try:
        anyio.run(server.serve, [sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0
