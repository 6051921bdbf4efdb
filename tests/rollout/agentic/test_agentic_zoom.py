"""The zoom-in vision-language environment (examples/agentic_zoom): its crop math, malformed calls and episode ends,
its reward; a real `relax train` run of the example on a tiny generated task (observation images reach the engine
and the trainer alike); and `relax eval` generating multi-turn episodes as training does."""

import json
import random
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoTokenizer

from examples.agentic_zoom import build_task
from examples.agentic_zoom.env_zoom import (
    MIN_DIMENSION,
    ZOOM_SIZE,
    ZoomEnv,
    ZoomError,
    bbox_arguments,
    crop_box,
    zoom,
    zoom_reward,
)
from relax.cli.main import main
from relax.data.multimodal import MultimodalSettings, VisionSpec
from relax.data.multimodal.image import resize_image
from relax.data.sample import Sample
from relax.rollout.agentic.tool_parser import parse_hermes_tool_calls
from relax.telemetry.metrics_file import read_metrics


def call(bbox, name="image_zoom_in_tool"):
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"bbox_2d": bbox}}) + "</tool_call>"


# ------------------------------------------------------------------------------------------------------ crop math


def test_a_grid_box_scales_to_pixels_and_is_clamped_to_the_image():
    assert crop_box(bbox_arguments({"bbox_2d": [100, 200, 300, 600]}), 200, 100) == (20, 20, 60, 60)
    assert crop_box(bbox_arguments({"bbox_2d": [-100, -50, 500, 2000]}), 200, 100) == (0, 0, 100, 100)
    # corners in either order name the same region
    assert bbox_arguments({"bbox_2d": [300, 600, 100, 200]}) == bbox_arguments({"bbox_2d": [100, 200, 300, 600]})


def test_a_small_box_grows_to_the_minimum_around_its_centre_and_stays_inside():
    left, top, right, bottom = crop_box((500, 500, 510, 510), 200, 100)  # 2 x 1 px around (101, 50.5)
    assert right - left == MIN_DIMENSION and bottom - top == MIN_DIMENSION
    assert left <= 101 <= right and top <= 50 <= bottom
    assert crop_box((0, 0, 10, 10), 200, 100) == (0, 0, MIN_DIMENSION, MIN_DIMENSION)  # shifted inside at the edge
    assert crop_box((990, 990, 1000, 1000), 200, 100) == (200 - MIN_DIMENSION, 100 - MIN_DIMENSION, 200, 100)


@pytest.mark.parametrize("arguments, message", [
    ({"bbox_2d": [1, 2, 3]}, "four numbers"),
    ({"bbox_2d": "0 0 10 10"}, "four numbers"),
    ({"bbox_2d": [0, "a", 10, 10]}, "finite numbers"),
    ({"bbox_2d": [0, 0, float("nan"), 10]}, "finite numbers"),
    ({"bbox_2d": [5, 0, 5, 10]}, "empty"),
    ({"bbox_2d": [0, 0, 10, 10], "scale": 2}, "unknown argument"),
    ({}, "four numbers"),
])
def test_bad_boxes_are_refused(arguments, message):
    with pytest.raises(ZoomError, match=message):
        bbox_arguments(arguments)


def test_a_box_outside_the_image_is_refused():
    with pytest.raises(ZoomError, match="outside the image"):
        crop_box((1100, 0, 1200, 500), 200, 100)


def test_the_zoom_shows_the_small_square_on_a_generated_picture():
    example = build_task.draw_picture(random.Random(7))
    crop = zoom(example.image, tuple(example.target_bbox))  # an 8x8-px square: grown to 28 px, then enlarged
    assert max(crop.size) == ZOOM_SIZE and min(crop.size) >= MIN_DIMENSION
    colours = {colour for _, colour in crop.getcolors(ZOOM_SIZE * ZOOM_SIZE)}
    assert build_task.COLOURS[example.colour] in colours


# ------------------------------------------------------------------------------------------------------ the env


@pytest.fixture
def env():
    return ZoomEnv(Image.new("RGB", (224, 224), "white"), chat_template="{{ '<tool_response>' }}")


def test_a_zoom_call_returns_the_crop_in_a_tool_response(env):
    observation, done, info = env.step("Let me look. " + call([400, 400, 600, 600]))
    assert not done and info == {"zoomed": True, "zooms": 1, "errors": 0}
    [crop] = observation["multi_modal_data"]["image"]
    assert crop.size == (ZOOM_SIZE, ZOOM_SIZE)
    assert observation["role"] == "user"  # a template that wraps tool results itself gets them as a user turn
    assert observation["obs_str"] == "<tool_response>\nZoomed in on [400, 400, 600, 600].\n</tool_response>"
    message = env.format_observation(observation)
    assert [item["type"] for item in message["content"]] == ["text", "image", "text"]
    assert message["content"][0]["text"] == "<tool_response>\n" and message["content"][1]["image"] is crop


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2</tool_call>', "invalid JSON"),
    ('<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}}', "missing </tool_call>"),
    (call([0, 0, 500, 500], name="image_rotate_tool"), "unknown tool 'image_rotate_tool'"),
    (call([0, 0, 500]), "four numbers"),
    (call([1200, 0, 1300, 500]), "outside the image"),
    (call([0, 0, 500, 500]) + call([500, 500, 900, 900]), "one zoom per turn"),
])
def test_a_malformed_call_gets_an_error_text_and_the_episode_goes_on(env, text, error):
    observation, done, info = env.step(text)
    assert not done and "multi_modal_data" not in observation
    assert observation["obs_str"].startswith("<tool_response>\nError: ") and error in observation["obs_str"]
    assert info == {"zoomed": False, "zooms": 0, "errors": 1}
    assert env.format_observation(observation) == {"role": "user", "content": observation["obs_str"]}


@pytest.mark.parametrize("text", ["<answer>red</answer>", "It is red.", call([0, 0, 500, 500]) + "<answer>red</answer>"])
def test_an_answer_or_a_turn_without_a_call_ends_the_episode(env, text):
    observation, done, _ = env.step(text)
    assert done and observation == {}


def episode(label, *turns):
    """A finished sample whose traces hold the turns' texts and the env's infos."""
    traces = [{"response_text": text, "env_info": info} for text, info in turns]
    return Sample(index=0, label=label, metadata={"rollout_traces": traces})


def test_the_reward_pays_the_answer_then_format_and_tool_terms():
    zoomed = {"zooms": 1, "errors": 0}
    right_with_zoom = episode("red", (call([0, 0, 9, 9]), zoomed), ("<answer> Red </answer>", zoomed))
    assert zoom_reward(None, right_with_zoom) == {"score": 1.2, "acc": 1.0, "format_error": 0.0, "tool": 1.0}
    right_without = episode("red", ("<answer>red</answer>", {"zooms": 0, "errors": 0}))
    assert zoom_reward(None, right_without)["score"] == 1.0
    wrong_with_zoom = episode("red", (call([0, 0, 9, 9]), zoomed), ("<answer>blue</answer>", zoomed))
    assert zoom_reward(None, wrong_with_zoom)["score"] == 0.0  # the tool bonus needs a right answer
    bad_call = episode("red", ("<tool_call>{", {"zooms": 0, "errors": 1}), ("<answer>red</answer>", {"zooms": 0,
                                                                                                  "errors": 1}))
    assert zoom_reward(None, bad_call)["score"] == pytest.approx(0.8)
    no_answer = episode("red", ("red", {"zooms": 0, "errors": 0}))
    assert zoom_reward(None, no_answer)["score"] == pytest.approx(-0.2)


# ------------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def tiny_zoom_task(tmp_path_factory) -> Path:
    """The example's task at test size: 8 train / 4 test pictures, a warm start just long enough for the tiny model
    to write zoom calls (most with the corners in place)."""
    out = tmp_path_factory.mktemp("zoom")
    build_task.build(out, num_train=8, num_test=4, sft_steps=70, sft_episodes=32, sft_batch=8)
    return out


def test_the_zoom_example_trains_end_to_end_with_observation_images(tiny_zoom_task, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--config", str(tiny_zoom_task / "config.yaml"), "--num-rollout", "2", "--output-dir",
                 str(run), "--rollout-temperature", "0.5", "--dump-samples", "16", "--eval-interval", "2"]) == 0
    steps = [row for row in read_metrics(run / "metrics.jsonl") if "rollout/turns_mean" in row]
    assert len(steps) == 2
    for step in steps:
        assert step["rollout/failed_ratio"] == 0 and step["rollout/turns_mean"] > 1
        # the engine and the trainer saw the same images (prompt + crops), so their log-probs agree
        assert abs(step["train/tis_mismatch_kl"]) < 1e-3 and step["train/tis_mismatch_k3_kl"] < 1e-4
    samples = [json.loads(line) for path in sorted((run / "samples").glob("*.jsonl")) for line in path.open()]
    image_token = AutoTokenizer.from_pretrained(tiny_zoom_task / "model").convert_tokens_to_ids("<|image_pad|>")
    zoomed = [s for s in samples if any((t.get("env_info") or {}).get("zoomed") for t in s["metadata"]["rollout_traces"])]
    assert zoomed, [t["response_text"] for s in samples for t in s["metadata"]["rollout_traces"]]
    for sample in zoomed:
        traces = sample["metadata"]["rollout_traces"]
        crops = [t for t in traces if (t.get("env_info") or {}).get("zoomed") and t["observation_tokens"]]
        picture = Image.open(sample["multimodal_inputs"]["image"][0])
        # the prompt's picture shown at 112x112 (16 tokens), then each crop the episode went on with
        expected = 16 + sum(crop_tokens(picture, trace["response_text"]) for trace in crops)
        assert sample["tokens"].count(image_token) == expected
        response = sample["tokens"][len(sample["tokens"]) - sample["response_length"]:]
        assert all(m == 0 for token, m in zip(response, sample["loss_mask"]) if token == image_token)


def crop_tokens(picture, response_text):
    """Vision tokens of the crop a zoom call yields, sized as the run sizes images (2x2-merged 14-px patches)."""
    arguments = parse_hermes_tool_calls(response_text).tool_calls[0].arguments
    settings = MultimodalSettings(image_min_token_num=build_task.IMAGE_MIN_TOKENS,
                                  image_max_token_num=build_task.IMAGE_MAX_TOKENS)
    shown = resize_image(zoom(picture, bbox_arguments(arguments)), settings, VisionSpec())
    return shown.width * shown.height // 28**2


ECHO_ENV = '''
from relax.rollout.agentic.env import BaseInteractionEnv

class TwoTurns(BaseInteractionEnv):
    def __init__(self):
        self.turns = 0

    def step(self, response_text):
        self.turns += 1
        return {"obs_str": "go on"}, self.turns == 2, {}

def build_env(sample, args):
    return TwoTurns()
'''


def test_relax_eval_plays_multi_turn_episodes_like_training(tiny_workspace, tmp_path, monkeypatch, capsys):
    (tmp_path / "two_turn_env.py").write_text(ECHO_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tiny_workspace / "model")
    letters = [str(i) for i in tokenizer.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))]
    common = ["eval", "--hf-checkpoint", str(tiny_workspace / "model"), "--eval-prompt-data", "held_out",
              str(tiny_workspace / "test.jsonl"), "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction",
              "--rollout-max-response-len", "8", "--eval-temperature", "1.0", "--rollout-stop-token-ids", *letters]
    assert main(common) == 0
    single_turn = capsys.readouterr().out
    assert "held_out: accuracy" in single_turn and "turns" not in single_turn
    assert main([*common, "--rollout-interaction-env-path", "two_turn_env", "--max-turns", "3",
                 "--rollout-max-context-len", "96"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert float(line.split("turns ")[1]) > 1, line  # episodes of two turns (one, where a turn hit the length cap)
