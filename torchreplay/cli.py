"""The `torchreplay` command (also `python -m torchreplay`): `demo` and `inspect`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchreplay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="GRPO with replay vs on-policy on embedded defaults (CPU, local disk); "
                   "see `torchreplay demo --help`", add_help=False)
    inspect = sub.add_parser("inspect", help="summarize a checkpoint: manifests, rollouts, bytes, ages, priorities")
    inspect.add_argument("uri", help="s3://bucket/prefix or file:///path")
    inspect.add_argument("--endpoint-url", default=None)
    inspect.add_argument("--tag", default=None, help="the checkpoint published with checkpoint(tag=...) (default: LATEST)")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "demo":
        from torchreplay.demo.__main__ import main as demo_main

        return demo_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "inspect":
        return inspect_checkpoint(args.uri, args.endpoint_url, args.tag)
    return 2


def inspect_checkpoint(uri: str, endpoint_url: str | None = None, tag: str | None = None) -> int:
    import torch

    from torchreplay.checkpoint.manifest import read_manifest
    from torchreplay.checkpoint.store import open_reader
    from torchreplay.checkpoint.restore import fetch_shard_metas, load_state
    from torchreplay.errors import CheckpointError
    from torchreplay.slots import TABLE_FIELDS
    from torchreplay.snapshot import BufferConfig

    try:
        store = open_reader(uri, endpoint_url)  # each read retried for up to 60 s, as a restore's
        manifests = store.list("manifests")
        tags = store.list("tags")
        manifest = read_manifest(store, tag=tag)
        state = load_state(store, manifest)
        config = BufferConfig.from_json(state["config"])
        shard_keys = store.list("shards")
        # Every shard the manifest names: a regular object whose header and small blocks (ranged
        # reads, no token data) fit the buffer's schema.
        fields = {k: v for k, v in config.fields().items() if k not in TABLE_FIELDS}
        metas = fetch_shard_metas(store, manifest, config.capacity, fields)
        shard_bytes = sum(meta.header.file_bytes for meta in metas.values())
    except (CheckpointError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"checkpoint: {uri}")
    print(f"manifests ({len(manifests)}): " + ", ".join(manifests))
    print(f"tags ({len(tags)}): " + ", ".join(t.removeprefix("tags/").removesuffix(".json") for t in tags))
    which = f"tag {tag}" if tag is not None else "latest"
    print(f"{which}: manifests/{manifest['sequence']:012d}.json  policy_version: {manifest['policy_version']}")
    print(f"rollouts: {manifest['rollouts']}  shards named: {len(manifest['shards'])}  shard objects: {len(shard_keys)}")
    print(f"state bytes: {manifest['state']['json_bytes'] + manifest['state']['blob_bytes']:,}  "
          f"shard bytes: {shard_bytes:,}")
    table = state["table"]
    live = table["live"]
    if int(live.sum()):
        ages = (state["version"] - table["policy_version"][live]).double()
        adv = table["advantage"][live].double().abs()
        reuse = table["reuse"][live].double()
        for name, values in (("age (policy versions)", ages), ("|advantage|", adv), ("reuse", reuse)):
            q = torch.quantile(values, torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=torch.float64)).tolist()
            print(f"{name:>22}: min {q[0]:.3g}  p50 {q[1]:.3g}  p90 {q[2]:.3g}  max {q[3]:.3g}")
    print(f"sampler: {state['sampler'].get('type')} {state['sampler'].get('config')}")
    print(f"config fingerprint: {config.fingerprint()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
