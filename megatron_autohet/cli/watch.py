"""`autohet watch`: wait for this node's preemption notice, write it to a file, exit 0.

Torch-free (megatron_autohet/elastic/notices.py, standard library only): it starts at once and
runs next to the training job on any node image.
"""

from __future__ import annotations

from megatron_autohet.cli._common import check_output_path, positive
from megatron_autohet.elastic import notices
from megatron_autohet.elastic.notices import SOURCES
from megatron_autohet.errors import ConfigError

SOURCES_ALLOWED = "aws, gcp, azure, signal (repeat --source for several)"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "watch", help="wait for a preemption notice (AWS, GCP, Azure, signals), write it to a "
                      "file",
        description="Watch this node's preemption notices until one says the node will go away, "
                    "write it to --notice-file (JSON, atomically) and exit 0. Sources: 'aws' "
                    "(IMDSv2 spot/instance-action, about 2 minutes ahead; a rebalance "
                    "recommendation is written and logged, and watching goes on), 'gcp' "
                    "(instance/preempted, about 30 s ahead, a hanging wait_for_change request), "
                    "'azure' (Scheduled Events: a Preempt event for this VM, about 30 s ahead), "
                    "'signal' (SIGTERM from Kubernetes, SIGUSR1 from Slurm's "
                    "--signal=B:USR1@N; the deadline is --signal-grace seconds after it "
                    "arrives). A metadata server that is unreachable is logged once and polled "
                    "on.")
    p.add_argument("--notice-file", default=None, metavar="PATH",
                   help="where to write the notice (required): JSON with source, kind "
                        "('preempt' or 'rebalance'), deadline_unix, received_unix, detail")
    p.add_argument("--source", action="append", default=None, metavar="SOURCE",
                   help="a notice source: aws, gcp, azure or signal; repeat for several "
                        "(at least one)")
    p.add_argument("--metadata-url", default=None, metavar="URL",
                   help="base URL of the metadata server for the cloud source(s) (default: "
                        "http://169.254.169.254 for aws and azure, "
                        "http://metadata.google.internal for gcp); e.g. a test server")
    p.add_argument("--azure-vm-name", default=None, metavar="NAME",
                   help="this VM's name as Scheduled Events lists it in Resources (default: "
                        "read from the instance metadata)")
    p.add_argument("--poll-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between two checks of a metadata server; gcp and signal wait "
                        "for the change instead (default: 5, AWS's recommendation)")
    p.add_argument("--signal-grace", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between the signal and the node's end: Kubernetes' "
                        "terminationGracePeriodSeconds, N of Slurm's --signal=B:USR1@N "
                        "(default: 30)")
    p.add_argument("--events-jsonl", default=None, metavar="PATH",
                   help="also append each notice as a JSON line here (event 'notice')")
    p.set_defaults(func=run)


def check_args(args) -> list[str]:
    """The sources to watch, in order, once every flag is known to be usable."""
    if not args.notice_file:
        raise ConfigError("<command line>", "--notice-file", "missing", "a file path")
    check_output_path(args.notice_file, "--notice-file")
    check_output_path(args.events_jsonl, "--events-jsonl")
    if not args.source:
        raise ConfigError("<command line>", "--source", "none given", SOURCES_ALLOWED)
    for source in args.source:
        if source not in SOURCES:
            raise ConfigError("<command line>", "--source", f"{source!r} is not a source",
                              SOURCES_ALLOWED)
    sources = list(dict.fromkeys(args.source))
    clouds = [s for s in sources if s != "signal"]
    if args.metadata_url is not None:
        if not clouds:
            raise ConfigError("<command line>", "--metadata-url", "given without a cloud "
                              "source", "with --source aws, gcp or azure")
        if not args.metadata_url.startswith(("http://", "https://")):
            raise ConfigError("<command line>", "--metadata-url", f"{args.metadata_url!r}",
                              "an http:// or https:// URL")
    if args.azure_vm_name is not None and "azure" not in sources:
        raise ConfigError("<command line>", "--azure-vm-name", "given without --source azure",
                          "with --source azure")
    positive(args.poll_interval, "--poll-interval")
    positive(args.signal_grace, "--signal-grace")
    return sources


def run(args) -> int:
    sources = check_args(args)
    url = {"base_url": args.metadata_url} if args.metadata_url else {}
    # gcp and signal wait inside poll() for the change, so their notice is seen at once.
    makers = {
        "aws": lambda: notices.AwsWatcher(**url),
        "gcp": lambda: notices.GcpWatcher(**url, wait_s=args.poll_interval),
        "azure": lambda: notices.AzureWatcher(**url, vm_name=args.azure_vm_name),
        "signal": lambda: notices.SignalWatcher(grace_s=args.signal_grace,
                                                wait_s=args.poll_interval),
    }
    watchers = [makers[source]() for source in sources]     # signal handlers installed here
    print(f" > watching {', '.join(sources)} for a preemption notice; notice file "
          f"{args.notice_file}", flush=True)
    try:
        notices.watch(watchers, args.notice_file, poll_interval_s=args.poll_interval,
                      events_jsonl=args.events_jsonl)
    except KeyboardInterrupt:
        return 130
    print(f" > wrote {args.notice_file}", flush=True)
    return 0
