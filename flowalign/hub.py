"""Publishing an export on the Hugging Face Hub (``flowalign export CHECKPOINT --push-to-hub REPO_ID``), through
``huggingface_hub``: the repository is created when it does not exist (``--private`` makes a new one private), then
the export folder (the weights, ``flowalign_export.json`` and the model card ``README.md``) is uploaded in one commit.
The endpoint is ``huggingface_hub``'s (``HF_ENDPOINT``), the token its own (``HF_TOKEN`` or ``hf auth login``)."""

from __future__ import annotations

import re
from pathlib import Path

from flowalign.config import ConfigError

__all__ = ["check_repo_id", "push_to_hub"]


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` when it is a hub model id (``owner/name``), else a ConfigError naming ``--push-to-hub``: checked
    before any model loads."""
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", repo_id or "") or ".." in repo_id:
        raise ConfigError(f"--push-to-hub {repo_id!r} is not a hub repository id: give OWNER/NAME, e.g. "
                          "--push-to-hub my-user/sd35-flow-grpo-lora", key="push_to_hub")
    return repo_id


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None,
                commit_message: str = "Upload a flowalign export") -> str:
    """Create ``repo_id`` (a model repository; private when ``private``; an existing one is kept as it is) and upload
    ``folder`` into it in one commit. Returns the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(check_repo_id(repo_id), repo_type="model", private=True if private else None, exist_ok=True)
    commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                               commit_message=commit_message)
    return str(commit.commit_url)
