"""``flowalign serve-reward [CONFIG] [key=value ...]``: serve registered rewards over HTTP for the ``remote`` reward
(``flowalign.remote.server``), built from ``ServeRewardConfig`` by the config loader."""

from __future__ import annotations

import argparse

from .options import ConfigCommand, add_config_command

__all__ = ["add_serve_reward"]


def _run_serve_reward(config, args: argparse.Namespace) -> None:
    from flowalign.remote.server import serve

    serve(config)


def add_serve_reward(commands) -> None:
    add_config_command(
        commands, "serve-reward", ConfigCommand("flowalign.remote.server:ServeRewardConfig", _run_serve_reward),
        help="serve registered rewards over HTTP, for the remote reward of train and sample configs",
        description="Build the rewards of CONFIG and serve them on --host:--port until SIGTERM or SIGINT (requests in "
        "flight finish first): GET /health, GET /v1/metadata (reward names, versions, image size), POST /v1/score "
        "(JSON with safetensors or PNG images; never pickle). Requests are merged into batches of at most "
        "--batch-size images; --token-file makes every request but /health carry that bearer token.",
    )
