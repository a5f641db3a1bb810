"""`paratrain checkpoint inspect|verify|export`: the commands that read snapshots and finished
runs (checkpoint/ does the work; these print what it found)."""

from __future__ import annotations

import argparse
from typing import Any


def add_commands(sub: Any) -> None:
    """`paratrain checkpoint ACTION` and its arguments, on the main parser's subparsers."""
    k = sub.add_parser("checkpoint",
                       help="look into training snapshots, verify them, export their weights")
    ksub = k.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    ksub.required = True
    ki = ksub.add_parser("inspect", help="step, world size, strategy, tensors, committed or not",
                         description="PATH: a snapshot folder (step-NNNNNNN), or a checkpoints "
                                     "folder or run dir to list its snapshots. Local or fsspec "
                                     "URL (s3://...).")
    ki.add_argument("path")
    ki.add_argument("--json", action="store_true", help="print JSON instead of text")
    ki.set_defaults(func=cmd_inspect)
    kv = ksub.add_parser("verify", help="check every file's size and checksum; exit 1 if any "
                                        "snapshot is bad",
                         description="PATH: a snapshot folder, or a checkpoints folder or run "
                                     "dir (every snapshot in it); local or fsspec URL (s3://...). "
                                     "One line per snapshot: ok, or the file that is missing, cut "
                                     "short or changed since it was written; then each damaged "
                                     "snapshot a resume moved aside (step-N.corrupt) and how to "
                                     "clear it. Exit code 0 when all snapshots are good, 1 "
                                     "otherwise.")
    kv.add_argument("path")
    kv.set_defaults(func=cmd_verify)
    ke = ksub.add_parser("export", help="one model.safetensors from a sharded snapshot",
                         description="PATH: a snapshot folder, a checkpoints folder or an "
                                     "unfinished run dir (its newest committed snapshot), or a "
                                     "finished run dir (its final model: model/, or a LoRA "
                                     "run's adapter/ unless --merge). OUT: a folder (model "
                                     "+ config.json + tokenizer.json, for `paratrain generate`) "
                                     "or a file ending in .safetensors. A fine-tuning run's "
                                     "snapshot (model.arch=hf) exports to a from_pretrained "
                                     "folder with its tokenizer: the whole model, or for LoRA "
                                     "the adapter alone (peft) or, with --merge, the merged "
                                     "model.")
    ke.add_argument("path")
    ke.add_argument("out")
    ke.add_argument("--format", choices=("paratrain", "hf"), default="paratrain",
                    help="hf: a finished run's model as a Hugging Face LlamaForCausalLM folder "
                         "with its tokenizer (transformers loads it offline)")
    ke.add_argument("--overwrite", action="store_true",
                    help="replace an OUT that is already there (a non-empty folder, a .safetensors "
                         "file); without it such an OUT is refused")
    ke.add_argument("--merge", action="store_true",
                    help="a LoRA snapshot: the base with the adapters merged in, instead of the "
                         "adapter alone")
    ke.add_argument("--model-path", default=None, metavar="DIR",
                    help="a fine-tuning snapshot: the base model it fine-tuned, when it is no "
                         "longer at the run's model.path")
    ke.set_defaults(func=cmd_export)


def cmd_inspect(ns: argparse.Namespace) -> int:
    import json

    from ..checkpoint import inspection, store
    _, step = store.split(ns.path)
    if step is None:  # a checkpoints folder or a run dir: one line per snapshot
        rows = inspection.listing(ns.path)
        if ns.json:
            print(json.dumps(rows, indent=2))
        for r in [] if ns.json else rows:
            state = "committed" if r["committed"] else "NOT committed"
            print(f"{r['path']}  step {r['step']}  {state}  {r['bytes']:,} bytes"
                  + (f"  unusable: {r['problem']}" if r["committed"] and r["problem"] else "")
                  + ("" if r["checksums"] or not r["committed"] else
                     "  no checksums (cannot be verified)"))
        return 0
    d = inspection.describe(ns.path)
    print(json.dumps(d, indent=2) if ns.json else inspection.format_description(d))
    return 0


def cmd_verify(ns: argparse.Namespace) -> int:
    """One line per snapshot; exit 0 when every one is good, 1 otherwise."""
    from ..checkpoint import inspection
    from ..errors import CheckpointError
    aside = inspection.set_aside(ns.path)
    try:
        verdicts = inspection.verify(ns.path)
    except CheckpointError:  # no snapshot folders: fine when some were set aside
        if not aside:
            raise
        verdicts = []
    for v in verdicts:
        print(v.line(), flush=True)
    for line in aside:
        print(line, flush=True)
    return 0 if all(v.good for v in verdicts) else 1


def cmd_export(ns: argparse.Namespace) -> int:
    from ..checkpoint import export_target, finetune_export
    from ..errors import ConfigError
    from ..redact import redact_url
    final = None if ns.model_path or ns.format == "hf" else \
        export_target.finished_model(ns.path, merge=ns.merge)
    if final is not None:  # a finished run: its final model, newer than any snapshot
        out = export_target.export_copy(final[0], ns.out, overwrite=ns.overwrite)
        print(f"wrote {out}: the finished run's final model ({final[0].name}/, step {final[1]})")
        return 0
    found = finetune_export.find(ns.path)  # a fine-tuning run's snapshot: from_pretrained
    if found is not None:
        out = finetune_export.export_finetuned(*found, ns.out, merge=ns.merge,
                                               model_path=ns.model_path, overwrite=ns.overwrite)
        print(f"wrote {out} from snapshot {redact_url(found[0])}")
        return 0
    if ns.merge or ns.model_path:
        raise ConfigError(f"--merge and --model-path apply to snapshots of fine-tuning runs "
                          f"(model.arch=hf); {ns.path!r} holds none")
    if ns.format == "hf":  # a finished run's model/ as a Hugging Face LlamaForCausalLM folder
        from ..checkpoint.hf_export import export_hf
        print(f"wrote {export_hf(ns.path, ns.out, overwrite=ns.overwrite)}")
        return 0
    from ..checkpoint.store import export_snapshot, resolve
    url = resolve(ns.path)
    print(f"wrote {export_snapshot(url, ns.out, overwrite=ns.overwrite)} from snapshot "
          f"{redact_url(url)}")
    return 0
