"""`paratrain checkpoint inspect|verify|export`: the commands that read snapshots and finished
runs (checkpoint/ does the work; these print what it found)."""

from __future__ import annotations

import argparse


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
