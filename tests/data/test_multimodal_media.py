"""Settings, media loading, image sizing and placeholder resolution of `relax.data.multimodal`, on real files."""

from __future__ import annotations

import base64
import dataclasses
import pickle

import numpy as np
import pytest
from PIL import Image

from relax.data.multimodal import (
    MediaError,
    MultimodalSettings,
    VisionSpec,
    fetch_image,
    image_alignment_factor,
    image_pixel_bounds,
    load_image,
    parse_multimodal_keys,
    resolve_prompt,
    resolve_row,
    smart_resize,
    to_rgb,
)
from relax.data.multimodal.image import widened_size
from relax.data.multimodal.pool import RowProcessingConfig, process_row
from tests.support.media_files import write_png

SPEC = VisionSpec()


# ---------------------------------------------------------------------------------------------------- settings
def test_settings_defaults_match_upstream():
    s = MultimodalSettings()
    assert (s.image_min_token_num, s.image_max_token_num) == (4, 16384)
    assert (s.video_min_token_num, s.video_max_token_num) == (128, 768)
    assert (s.video_fps, s.video_fps_min_frames, s.video_fps_max_frames, s.frame_factor) == (2.0, 4, 768, 2)
    assert s.audio_sample_rate == 16000 and s.image_resize_scale_factor is None
    # 4 * 28^2 and 16384 * 28^2 (about 12.85 M pixels)
    assert image_pixel_bounds(s, SPEC) == (3136, 12_845_056)


def test_settings_are_frozen_and_validated():
    s = MultimodalSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.video_fps = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="image_max_token_num"):
        MultimodalSettings(image_min_token_num=10, image_max_token_num=5)
    with pytest.raises(ValueError, match="video_fps"):
        MultimodalSettings(video_fps=0)


def test_settings_from_config_reads_known_fields_only():
    s = MultimodalSettings.from_config({"video_fps": 1.0, "frame_factor": 4, "unrelated": 1})
    assert s.video_fps == 1.0 and s.frame_factor == 4 and s.image_max_token_num == 16384


@pytest.mark.parametrize("value, expected", [(None, 28), (0, None), (32, 32)])
def test_image_alignment_factor(value, expected):
    assert image_alignment_factor(MultimodalSettings(image_resize_scale_factor=value), SPEC) == expected


def test_parse_multimodal_keys_accepts_json_and_dict():
    keys = {"image": "images", "video": "videos", "audio": "audios"}
    assert parse_multimodal_keys('{"image":"images","video":"videos","audio":"audios"}') == keys
    assert parse_multimodal_keys(keys) == keys
    assert parse_multimodal_keys(None) == {} and parse_multimodal_keys("") == {}


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"picture": "images"}', "unknown media type 'picture'"),
        ("{image: images}", "not valid JSON"),
        ('["image"]', "must be a JSON object"),
        ('{"image": ""}', "non-empty string"),
        ('{"image": "m", "audio": "m"}', "same column"),
    ],
)
def test_parse_multimodal_keys_errors_name_the_flag(value, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_multimodal_keys(value)
    assert "--multimodal-keys" in str(info.value)


# ------------------------------------------------------------------------------------------------- smart_resize
def test_smart_resize_rounds_to_nearest_multiple_when_within_bounds():
    # round(1080/28)=round(38.57)=39 -> 1092; round(1920/28)=round(68.57)=69 -> 1932; 2.1 M px is within bounds
    assert smart_resize(1080, 1920, 28, 3136, 12_845_056) == (1092, 1932)
    # 1024 -> round(36.57)=37 -> 1036: a 1024^2 image costs 37*37 = 1369 tokens
    assert smart_resize(1024, 1024) == (1036, 1036)


def test_smart_resize_shrinks_with_floor_to_the_max_budget():
    # 100 tokens = 78400 px. beta = sqrt(1000*2000/78400) = 5.0508; 1000/beta = 197.99 -> floor(7.07)*28 = 196;
    # 2000/beta = 395.98 -> floor(14.14)*28 = 392. 7*14 = 98 tokens <= 100.
    assert smart_resize(1000, 2000, 28, 3136, 100 * 784) == (196, 392)


def test_smart_resize_grows_with_ceil_to_the_min_budget():
    # rounded 28x56 = 1568 < 3136. beta = sqrt(3136/1500) = 1.4459; 30*beta = 43.4 -> ceil(1.55)*28 = 56;
    # 50*beta = 72.3 -> ceil(2.58)*28 = 84.
    assert smart_resize(30, 50, 28, 3136, 12_845_056) == (56, 84)


def test_smart_resize_without_alignment_only_applies_the_pixel_bounds():
    assert smart_resize(100, 150, None, 3136, 12_845_056) == (100, 150)
    # beta = sqrt(40000/10000) = 2 -> 100x100
    assert smart_resize(200, 200, None, 3136, 10_000) == (100, 100)


def test_smart_resize_rejects_aspect_ratio_over_200():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010)
    assert smart_resize(10, 2000, 28, 28 * 28, 12_845_056)  # exactly 200 is allowed


def test_extreme_aspect_ratio_is_widened_to_199_before_resizing(tmp_path):
    assert widened_size(10, 2010) == (11, 2010)  # ceil(2010 / 199) = 11
    assert widened_size(2010, 10) == (2010, 11)
    assert widened_size(10, 2000) == (10, 2000)
    # 4x1000 (ratio 250) -> 6x1000 (ceil(1000/199)) -> smart_resize: max(28, round(6/28)*28)=28, round(35.7)*28=1008
    img = fetch_image(write_png(tmp_path / "ruler.png", height=4, width=1000), MultimodalSettings(), SPEC)
    assert img.size == (1008, 28)


def test_fetch_image_respects_token_limits(tmp_path):
    path = write_png(tmp_path / "big.png", height=300, width=400)
    img = fetch_image(path, MultimodalSettings(image_max_token_num=16), SPEC)
    h, w = img.height, img.width
    assert h % 28 == 0 and w % 28 == 0 and (h // 28) * (w // 28) <= 16
    # beta = sqrt(120000 / 12544) = 3.093; 300/beta = 97.0 -> 84; 400/beta = 129.3 -> 112
    assert (h, w) == (84, 112)


# --------------------------------------------------------------------------------------------------------- RGB
def test_to_rgb_composites_transparency_over_white():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    rgba.putpixel((0, 0), (0, 0, 255, 255))
    rgb = to_rgb(rgba)
    assert rgb.mode == "RGB" and rgb.getpixel((1, 1)) == (255, 255, 255) and rgb.getpixel((0, 0)) == (0, 0, 255)
    assert to_rgb(Image.new("L", (2, 2), 7)).getpixel((0, 0)) == (7, 7, 7)
    p = Image.new("P", (2, 2), 0)
    p.info["transparency"] = 0
    assert to_rgb(p).getpixel((0, 0)) == (255, 255, 255)


# ---------------------------------------------------------------------------------------------- media loading
@pytest.fixture
def png(tmp_path):
    return write_png(tmp_path / "img.png", height=20, width=30, seed=3)


def _forms(path):
    raw = path.read_bytes()
    b64 = base64.b64encode(raw).decode()
    return {
        "path": str(path),
        "file_url": f"file://{path}",
        "bytes": raw,
        "bytearray": bytearray(raw),
        "base64": b64,
        "data_uri": f"data:image/png;base64,{b64}",
        "dict_bytes": {"bytes": raw, "path": None},
        "dict_base64": {"base64": b64},
        "dict_path": {"path": str(path)},
        "pil": Image.open(path),
    }


@pytest.mark.parametrize(
    "form",
    ["path", "file_url", "bytes", "bytearray", "base64", "data_uri", "dict_bytes", "dict_base64", "dict_path", "pil"],
)
def test_every_accepted_image_form_decodes_to_the_same_pixels(png, form):
    expected = np.asarray(Image.open(png).convert("RGB"))
    img = load_image(_forms(png)[form])
    assert np.array_equal(np.asarray(img.convert("RGB")), expected)


@pytest.mark.parametrize(
    "item, message",
    [
        ("https://example.com/cat.png", "remote media are not fetched"),
        ("http://example.com/cat.png", "remote media are not fetched"),
        ("/no/such/file.png", "file not found"),
        ("file:///no/such/file.png", "file not found"),
        (b"not an image at all", "corrupt image (cannot identify image file)"),
        (b"", "empty media payload"),
        ({"url": "x"}, "needs a 'bytes', 'base64' or 'path'"),
        (12, "unsupported media item of type int"),
        ("data:image/png;base64,@@@", "invalid base64"),
    ],
)
def test_bad_image_items_raise_media_error(item, message):
    with pytest.raises(MediaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_image(item)


def test_truncated_png_is_a_media_error_not_a_pil_traceback(png):
    with pytest.raises(MediaError, match="corrupt image"):
        load_image(png.read_bytes()[:120])


def test_media_error_message_names_row_and_field_and_pickles(png, tmp_path):
    row = {"prompt": "<image><image>", "images": [str(png), b"\x89PNG broken"]}
    config = RowProcessingConfig(keys={"image": "images"})
    with pytest.raises(MediaError) as info:
        process_row(row, 12, config)
    assert str(info.value) == "row 13, field 'images'[1]: corrupt image (cannot identify image file)"
    clone = pickle.loads(pickle.dumps(info.value))
    assert (clone.row, clone.field, clone.index, str(clone)) == (12, "images", 1, str(info.value))


def test_empty_file_is_a_media_error(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(MediaError, match="empty media file"):
        load_image(str(tmp_path / "empty.png"))


# -------------------------------------------------------------------------------------------------- placeholders
KEYS = {"image": "images", "video": "videos", "audio": "audios"}


def test_string_prompt_placeholders_take_column_items_in_order():
    row = {"prompt": "A <image> then <audio> and <image>.", "images": ["i0", "i1"], "audios": ["a0"]}
    resolved = resolve_row(row, KEYS, row_index=3)
    assert resolved.messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "A "},
                {"type": "image", "image": "i0"},
                {"type": "text", "text": " then "},
                {"type": "audio", "audio": "a0"},
                {"type": "text", "text": " and "},
                {"type": "image", "image": "i1"},
                {"type": "text", "text": "."},
            ],
        }
    ]
    assert [(r.kind, r.field, r.index) for r in resolved.media] == [
        ("image", "images", 0), ("audio", "audios", 0), ("image", "images", 1)
    ]


def test_chat_messages_with_typed_items_and_inline_media():
    prompt = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "and <video>"},
                {"type": "image"},  # a typed placeholder: takes images[0]
                {"type": "audio", "audio": "inline.wav"},
                {"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}},
            ],
        },
    ]
    resolved = resolve_prompt(prompt, {"image": ("images", ["col_img"]), "video": ("videos", ["col_vid"])})
    assert resolved.messages[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert resolved.messages[1]["content"] == [
        {"type": "image", "image": "data:image/png;base64,AAAA"},
        {"type": "text", "text": "and "},
        {"type": "video", "video": "col_vid"},
        {"type": "image", "image": "col_img"},
        {"type": "audio", "audio": "inline.wav"},
        {"type": "audio", "audio": {"base64": "QUJD"}},
    ]
    assert resolved.media[0].field == "prompt[1].content[0]" and resolved.media[0].index is None


def test_placeholder_without_media_names_row_and_column():
    with pytest.raises(MediaError) as info:
        resolve_row({"prompt": "<image> <image>", "images": ["only one"]}, KEYS, row_index=5)
    assert str(info.value) == "row 6, field 'images'[1]: <image> placeholder #2 has no media (column holds 1)"


def test_media_left_without_placeholder_names_row_and_column():
    with pytest.raises(MediaError) as info:
        resolve_row({"prompt": "<audio>", "audios": ["a", "b", "c"]}, KEYS, row_index=7)
    assert str(info.value) == (
        "row 8, field 'audios'[1]: 2 audio item(s) left without a placeholder (1 placeholders for 3 items)"
    )


def test_placeholder_for_unmapped_media_type_names_the_flag():
    with pytest.raises(MediaError, match="--multimodal-keys maps no column for 'video'") as info:
        resolve_row({"prompt": [{"role": "user", "content": "<video>"}]}, {"image": "images"}, row_index=0)
    assert info.value.field == "prompt[0].content"


def test_missing_column_and_single_value_column():
    assert resolve_row({"prompt": "text only"}, KEYS).media == []
    assert [r.value for r in resolve_row({"prompt": "<image>", "images": "one.png"}, KEYS).media] == ["one.png"]


def test_unknown_content_type_is_a_media_error():
    with pytest.raises(MediaError, match="unknown content item type 'hologram'"):
        resolve_prompt([{"role": "user", "content": [{"type": "hologram"}]}], {}, row_index=1)


def test_settings_field_names_are_the_upstream_flag_names():
    flags = ["--image-min-token-num", "--image-max-token-num", "--video-min-token-num", "--video-max-token-num",
             "--video-fps", "--video-fps-min-frames", "--video-fps-max-frames", "--frame-factor",
             "--audio-sample-rate", "--image-resize-scale-factor", "--use-audio-in-video"]
    assert sorted(f[2:].replace("-", "_") for f in flags) == sorted(f.name for f in dataclasses.fields(MultimodalSettings))


def test_vision_spec_is_read_from_the_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = VisionSpec.from_image_processor(Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3,
                                                                    image_std=[0.5] * 3))  # Qwen3-VL geometry
    assert (spec.patch_size, spec.merge_size, spec.token_pixel_side, spec.image_mean) == (16, 2, 32, (0.5,) * 3)
    assert image_pixel_bounds(MultimodalSettings(), spec) == (4 * 1024, 16384 * 1024)


def test_disabled_alignment_keeps_the_image_size_but_model_inputs_still_get_whole_patches(tmp_path):
    path = write_png(tmp_path / "odd.png", height=100, width=150)
    config = RowProcessingConfig(settings=MultimodalSettings(image_resize_scale_factor=0), keys={"image": "images"})
    row = process_row({"prompt": "<image>", "images": [str(path)]}, 0, config)
    assert row.images[0].size == (150, 100)
    # the encoder copy is smart-resized like the HF processor: round(100/28)*28 = 112, round(150/28)*28 = 140
    assert row.model_inputs["image_grid_thw"].tolist() == [[1, 8, 10]]
