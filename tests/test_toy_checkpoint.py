"""The shipped toy pipeline: loads with plain diffusers and with the adapter, fits its budget, draws visible shapes."""

from pathlib import Path

import torch
from diffusers import StableDiffusion3Pipeline

from flowalign.evaluation.toy_eval import generate
from flowalign.models import load_flow_model
from flowalign.toy.detector import detect_batch
from flowalign.toy.prompts import PROMPT_ASSET_DIR
from flowalign.evaluation.geneval import load_metadata

CHECKPOINT = Path(__file__).resolve().parents[1] / "assets" / "toy-sd3"


def test_checkpoint_is_safetensors_within_budget():
    files = [f for f in CHECKPOINT.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 30 * 2**20
    weights = [f for f in files if f.suffix in (".safetensors", ".bin", ".pt")]
    assert weights and all(f.suffix == ".safetensors" for f in weights)


def test_plain_diffusers_pipeline_generates():
    pipe = StableDiffusion3Pipeline.from_pretrained(CHECKPOINT)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(["a photo of a red circle"] * 2, num_inference_steps=10, guidance_scale=1.0, height=32, width=32,
                  max_sequence_length=12, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (2, 3, 32, 32)


def test_adapter_generates_8_images_with_visible_shapes():
    """One batch of 8 held-out prompts, 10 ODE steps (about a second on 2 idle cores; speed is not asserted here)."""
    model = load_flow_model(CHECKPOINT)
    prompts = load_metadata(PROMPT_ASSET_DIR / "test.jsonl")[:8]
    images = generate(model, prompts, steps=10, images_per_prompt=1, seed=0)
    assert images.shape == (8, 3, 32, 32)
    found = [sum(len(v) for v in d.values()) for d in detect_batch(images)]
    assert sum(n > 0 for n in found) >= 6, found
