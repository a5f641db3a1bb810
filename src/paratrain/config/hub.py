"""Hugging Face Hub model ids (`org/name`) as model folders: resolved once, before any worker
starts, through huggingface_hub's own cache exactly as transformers resolves them.

`resolve_folder` is the one resolver: model.path, rl.reward_models, dpo.reference and the
`--model-path` of `checkpoint export` all go through it (config/model_folder.py calls it when a
config is built). A Hub id becomes the snapshot folder in the cache
(`<cache>/models--org--name/snapshots/<commit>`), downloaded when it is not there yet and the
network is allowed, read from the cache when it is (`HF_HUB_OFFLINE=1`: never a request). The
folder's path names the id and the commit, so a run's config.yaml records the exact revision and
is read again on another machine from that machine's cache (`hub_origin`).

Once per node: a config is built once per node by the launcher before its workers start, and
huggingface_hub takes a file lock per file it downloads, so processes that resolve one id at once
(torchrun's ranks building their own configs) download each file once and the others read it.
Tokens: huggingface_hub reads HF_TOKEN or its login itself; nothing here holds or prints one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ConfigError

# org/name as the Hub spells a repository (no leading ./ ~ or /: those are local paths).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# A snapshot folder of huggingface_hub's cache: models--org--name/snapshots/<40-hex commit>.
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/"
                       r"(?P<commit>[0-9a-f]{40})/?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# The files a model folder is read from: weights as safetensors (what paratrain loads), configs,
# tokenizers and a model's own code; not .bin / .h5 / .msgpack / onnx copies of the weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py", "*.pkl",
                  "merges.txt", "1_Pooling/*", "*.jinja"]


@dataclass(frozen=True)
class HubOrigin:
    """Where a snapshot folder came from: its Hub id and the commit it holds."""
    repo_id: str
    commit: str


def looks_like_hub_id(path: Optional[str]) -> bool:
    """`org/name` that is not a local path that exists (a local folder of that name wins, as in
    transformers)."""
    return bool(path) and bool(_HUB_ID.match(str(path))) and not Path(str(path)).exists()


def hub_origin(path: Optional[str]) -> Optional[HubOrigin]:
    """The id and commit a snapshot folder of the cache holds (None: not such a folder)."""
    m = _SNAPSHOT.search(str(path or ""))
    if not m:
        return None
    return HubOrigin(f"{m['org']}/{m['name']}", m["commit"])


def hub_model(path: Optional[str]) -> Optional[dict]:
    """summary.json's record of a model read from the Hub: {"id", "revision": the commit}."""
    origin = hub_origin(path)
    return {"id": origin.repo_id, "revision": origin.commit} if origin else None


def display_name(path: Optional[str]) -> str:
    """The model's name for run names and log lines: `name` of a Hub snapshot, else the folder's
    own name."""
    origin = hub_origin(path)
    if origin:
        return origin.repo_id.split("/")[-1]
    folder = Path(str(path)).expanduser()
    return folder.name or folder.resolve().name


def resolve_folder(path: Optional[str], revision: Optional[str] = None,
                   key: str = "model.path") -> Optional[str]:
    """`path` as a local model folder: a Hub id (at `revision`: a branch, tag or commit; null:
    main) becomes its snapshot folder in the cache; a snapshot folder that this machine's cache
    does not hold at that path (a config.yaml from elsewhere) is looked up again by its id and
    commit; anything else is returned as it is (the config checks say what a local path
    lacks)."""
    if not path:
        return path
    text = str(path)
    origin = hub_origin(text)
    if origin and not Path(text).expanduser().is_dir():
        return _snapshot(origin.repo_id, origin.commit, key)
    if looks_like_hub_id(text):
        return _snapshot(text, revision, key)
    return text


def _snapshot(repo_id: str, revision: Optional[str], key: str, repo_type: str = "model") -> str:
    """The cached snapshot folder of repo_id at revision, downloaded first when allowed."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ConfigError(f"{key}={repo_id!r} is a Hugging Face Hub id, read through "
                          "huggingface_hub: pip install 'paratrain[hf]'") from None
    cache = Path(constants.HF_HUB_CACHE)
    folder = _cached_commit(cache, repo_id, revision, repo_type)
    if folder is not None:  # an exact commit already cached: no request at all
        return folder
    where = f"{repo_id}@{revision}" if revision else repo_id
    flag = " --repo-type dataset" if repo_type == "dataset" else ""
    try:
        return str(snapshot_download(repo_id, revision=revision, repo_type=repo_type,
                                     allow_patterns=ALLOW_PATTERNS if repo_type == "model"
                                     else None))
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE=1 is set, so nothing is downloaded" if constants.HF_HUB_OFFLINE
               else "the Hub cannot be reached")
        raise ConfigError(
            f"{key}={where!r} is not in the Hugging Face cache ({cache}) and {why}: download it "
            f"once with network (`hf download {repo_id}{flag}`, or a run without "
            "HF_HUB_OFFLINE=1), "
            "point HF_HUB_CACHE at a cache that holds it, or give a local folder") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        why = ("is private, gated or does not exist: accept its terms on the Hub and set HF_TOKEN "
               "or run `hf auth login`" if status in (401, 403, 404)
               else f"could not be downloaded (HTTP {status})")
        raise ConfigError(f"{key}={where!r} {why}; the cache is {cache}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}={where!r} could not be read from the Hugging Face cache "
                          f"({cache}): {type(e).__name__}") from None


def _cached_commit(cache: Path, repo_id: str, revision: Optional[str],
                   repo_type: str = "model") -> Optional[str]:
    """The snapshot folder of an exact commit (or of a ref the cache already resolved, when the
    Hub is not to be asked) that is already in the cache, else None."""
    from huggingface_hub import constants
    storage = cache / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    commit = revision if revision and _COMMIT.match(revision) else None
    if commit is None and constants.HF_HUB_OFFLINE:
        ref = storage / "refs" / (revision or "main")
        commit = ref.read_text().strip() if ref.is_file() else None
    folder = storage / "snapshots" / commit if commit else None
    return str(folder) if folder is not None and folder.is_dir() else None


# A Hub dataset as data.source names it: hf://datasets/org/name, optionally @revision.
_DATASET = re.compile(r"^hf://datasets/(?P<id>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?/?$")


def is_hub_dataset(source: object) -> bool:
    return isinstance(source, str) and source.startswith("hf://datasets/")


def pin_dataset(source: str, key: str = "data.source") -> str:
    """hf://datasets/org/name[@rev] -> hf://datasets/org/name@<commit>, its files in
    huggingface_hub's cache (downloaded once when allowed; HF_HUB_OFFLINE=1: read from the
    cache), decided once when the config is built; one ConfigError line when neither works."""
    m = _DATASET.match(source)
    if not m:
        raise ConfigError(f"{key}={source!r} is not a Hub dataset as hf://datasets/org/name "
                          "(optionally @revision)")
    folder = _snapshot(m["id"], m["rev"], key, repo_type="dataset")
    return f"hf://datasets/{m['id']}@{Path(folder).name}"


def dataset_folder(source: str, key: str = "data.source") -> str:
    """The local snapshot folder of a Hub dataset (pinned by `pin_dataset`: no request)."""
    m = _DATASET.match(source)
    if not m:
        raise ConfigError(f"{key}={source!r} is not a Hub dataset as hf://datasets/org/name")
    return _snapshot(m["id"], m["rev"], key, repo_type="dataset")


def pin_sources(cfg: object) -> None:
    """data.source and data.val_source as Hub datasets pinned to the commit they resolve to."""
    d = cfg.data  # type: ignore[attr-defined]
    if is_hub_dataset(d.source):
        d.source = pin_dataset(d.source, "data.source")
    if is_hub_dataset(d.val_source):
        d.val_source = pin_dataset(d.val_source, "data.val_source")


def load_hub_dataset(source: str, subset: Optional[str], split: str, key: str) -> object:
    """The `datasets.Dataset` of a Hub dataset's split (slicing as datasets takes it), loaded by
    `datasets.load_dataset` from its snapshot folder: prepared once into datasets' cache
    (HF_DATASETS_CACHE), then memory-mapped from there."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{key}={source!r} is read with the datasets package: pip install "
                          "'paratrain[hf]'") from None
    folder = dataset_folder(source, key)
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(folder, subset, split=split)
    except (ValueError, KeyError, FileNotFoundError) as e:
        from ..formatting import first_line
        raise ConfigError(f"{key}={source!r} with data.subset={subset!r} and split {split!r} "
                          f"cannot be loaded: {first_line(e)[:300]}") from None
