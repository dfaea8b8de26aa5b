"""Models named by Hugging Face hub id (`org/name`, or `org/name:file.gguf` for one GGUF file),
fetched with huggingface_hub into its cache (or --download-dir), only the files the engine reads.

huggingface_hub does what users of every peer engine rely on: HF_TOKEN for gated repos,
HF_HUB_OFFLINE to use the cache only, a file lock per file so that processes of one node that
ask at once download it once, and progress bars. The engine resolves the id once, in the process
that reads the configuration; its workers get the local directory.
"""

from __future__ import annotations

import os
import re

from shardlm.logger import init_logger

logger = init_logger(__name__)

# what a model directory needs: config, generation defaults, tokenizer, chat template, weights, and
# the Python files of a config or tokenizer of the repository's own (--trust-remote-code)
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_hub_id(name: str) -> bool:
    """org/name (or name) with a hub's characters, and not a path that exists here."""
    repo = name.split(":", 1)[0]
    return bool(_HUB_ID.match(repo)) and not os.path.exists(os.path.expanduser(name)) and ".." not in repo


def names_hub_model(name: str, download_dir: str | None = None) -> bool:
    """A hub id, not a path here nor a directory under download_dir."""
    local = download_dir and os.path.isdir(os.path.join(os.path.expanduser(download_dir), name))
    return looks_like_hub_id(name) and not local


def local_path(name: str, revision: str | None = None, download_dir: str | None = None,
               require_config: bool = True) -> str:
    """`name` as it is where it is not a hub id, else the local path of the hub model it names
    (fetched into the cache)."""
    return download_model(name, revision, download_dir, require_config) if names_hub_model(name, download_dir) \
        else name


def config_dir(name: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The directory of the config.json that `name` gives (--hf-config-path): a directory here, a
    config.json file, or a hub repo, of which config.json alone is fetched."""
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not names_hub_model(name, download_dir):
        return path
    return os.path.dirname(download_model(f"{name}:config.json", revision, download_dir))


def offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def download_model(name: str, revision: str | None = None, download_dir: str | None = None,
                   require_config: bool = True) -> str:
    """The local path of a hub model: a snapshot directory, or for `repo:FILE` (one GGUF file, or
    the config.json of --hf-config-path) that file alone.
    ValueError with what to do when it cannot be had (offline and not cached, gated, missing)."""
    import huggingface_hub
    repo, _, one_file = name.partition(":")
    where = download_dir and os.path.expanduser(download_dir)
    try:
        if one_file:
            return huggingface_hub.hf_hub_download(repo, one_file, revision=revision, cache_dir=where,
                                                   local_files_only=offline())
        path = huggingface_hub.snapshot_download(repo, revision=revision, cache_dir=where,
                                                 allow_patterns=MODEL_FILES, local_files_only=offline())
    except Exception as e:        # huggingface_hub's errors, network errors: one message that says what to do
        raise ValueError(_explain(name, revision, where, e)) from None
    if require_config and not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"The hub repo {repo!r} has no config.json: shardlm loads Hugging Face model repos "
                         "(config.json, *.safetensors, tokenizer) or one GGUF file of a repo, named as "
                         f"'{repo}:FILE.gguf'.")
    logger.info("Model %s%s: %s", name, f" at revision {revision}" if revision else "", path)
    return path


def _explain(name: str, revision: str | None, cache: str | None, error: Exception) -> str:
    from huggingface_hub import errors
    at = f" at revision {revision!r}" if revision else ""
    kind = type(error).__name__
    if isinstance(error, errors.GatedRepoError):
        return (f"The hub repo {name!r} is gated: accept its terms on huggingface.co and set HF_TOKEN to a token "
                f"of your account ({kind}).")
    if isinstance(error, errors.RevisionNotFoundError):
        return f"The hub repo {name!r} has no revision {revision!r} ({kind})."
    if isinstance(error, errors.RepositoryNotFoundError):
        return (f"No hub repo {name!r} (or it is private: set HF_TOKEN). Pass a local directory or .gguf file, or "
                f"a repo id as org/name ({kind}).")
    if isinstance(error, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)) or offline():
        return (f"{name!r}{at} is not a local directory, and not in the hub cache ({cache or 'HF_HOME / HF_HUB_CACHE'}"
                f"), and cannot be downloaded "
                f"{'with HF_HUB_OFFLINE set' if offline() else 'from here (no connection to the hub)'}. Download it "
                f"where the hub is reachable (`huggingface-cli download {name.partition(':')[0]}"
                f"{' --revision ' + revision if revision else ''}`) into that cache, or pass a local directory "
                f"({kind}).")
    if isinstance(error, errors.EntryNotFoundError):
        return f"The hub repo {name.partition(':')[0]!r} has no file {name.partition(':')[2]!r}{at} ({kind})."
    return f"Could not fetch {name!r}{at} from the hub: {kind}: {error}"


def model_on_this_node(path: str, source: tuple[str, str | None, str | None] | None) -> str | None:
    """The model's directory on this node: `path` where it exists (one node, or shared storage),
    else the hub model fetched into this node's own cache (source: hub id, revision, download
    dir); None where neither."""
    if os.path.exists(path):
        return path
    if source is None:
        return None
    name, revision, download_dir = source
    return download_model(name, revision, download_dir)
