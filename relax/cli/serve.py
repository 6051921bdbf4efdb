"""`relax serve`: a model folder served by the embedded engine over HTTP (docs/serving.md)."""

from __future__ import annotations

import sys

from relax.cli.common import in_range, nonblank, port_number, positive, quiet_libraries, setup_logging


def cmd_serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    setup_logging(None)
    quiet_libraries()
    from relax.backends.models.gguf_source import hf_folder_of_gguf, is_gguf
    from relax.serving.limits import GenerationLimits
    from relax.serving.server import serve
    from relax.utils.http_server import HTTPLimits

    try:
        http = HTTPLimits(args.max_request_bytes, args.max_connections, args.header_timeout_s, args.body_timeout_s,
                          shutdown_grace_s=args.shutdown_grace_s)
        work = GenerationLimits(args.max_sequences_per_request, args.max_tokens_per_request,
                                args.max_inflight_sequences)
        core = core_settings_of(args)
        model = model_source(args.hf_checkpoint, args.gguf_file)
        if is_gguf(model):  # dequantised once into a cached Hugging Face folder
            model = str(hf_folder_of_gguf(model))
        serve(model, host=args.host, port=args.port, api_key=args.api_key, device=args.device,
              dtype=args.dtype, served_model_name=args.served_model_name, max_batch_size=args.max_batch_size,
              batch_window_ms=args.batch_window_ms, log_level=args.log_level,
              weight_update_root=args.weight_update_root, core=core, http_limits=http, generation_limits=work,
              cpu_threads=args.cpu_threads)
    except ValueError as err:
        print(f"relax serve: error: {err}", file=sys.stderr)
        return 2
    return 0


def core_settings_of(args):
    """The engine's settings `relax serve`'s flags name (a run passes its own on: `launched_relax.core_arguments`)."""
    from relax.backends.inference.embedded import CoreSettings

    return CoreSettings(mode=args.engine_core, mem_fraction_static=args.mem_fraction_static,
                        max_total_tokens=args.max_total_tokens, max_prefill_tokens=args.max_prefill_tokens,
                        page_size=args.page_size, cuda_graphs=not args.disable_cuda_graph,
                        max_graph_batch=args.cuda_graph_max_bs, kv_cache_dtype=args.kv_cache_dtype)


def serve_parser():
    """`relax serve`'s flags."""
    from relax.cli.args import CommandLineParser
    from relax.serving.limits import GenerationLimits
    from relax.utils.http_server import HTTPLimits

    http, work = HTTPLimits(), GenerationLimits()
    parser = CommandLineParser(
        prog="relax serve", description="Serve a model folder with the embedded engine over HTTP: SGLang's native "
        "protocol (/generate, /update_weights_from_disk, ...) and the OpenAI protocol (/v1/...). See docs/serving.md.")
    parser.add_argument("--hf-checkpoint", required=True, help="Hugging Face model folder (config, weights, tokenizer), "
                        "or a GGUF file (dequantised once into a cached folder, docs/gguf.md)")
    parser.add_argument("--gguf-file", help="name of a GGUF file inside the --hf-checkpoint folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=port_number, default=30000, help="port to listen on (1-65535)")
    parser.add_argument("--api-key", default=None, type=nonblank,
                        help="bearer token required by the control endpoints (default: $RELAX_API_KEY; none: open)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--cpu-threads", type=in_range(int, 0, 1024), default=0,
                        help="threads torch computes with on CPU (0: measured at start, as relax train does)")
    parser.add_argument("--served-model-name", default=None, type=nonblank, help="model id of /v1/models (default: the folder name)")
    parser.add_argument("--max-batch-size", type=positive(int), default=256,
                        help="most sequences decoded together (one decode step's rows; the rest wait their turn)")
    parser.add_argument("--batch-window-ms", type=in_range(float, 0, 10_000), default=5.0,
                        help="how long the first waiting request collects others into one engine batch (0-10000)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--engine-core", default="auto", choices=["auto", "on", "off"],
                        help="the engine core's runner: auto = the paged one (paged KV, CUDA graphs) for the "
                        "families it runs, the model's own forward and cache for the others; on = the paged one "
                        "only; off = the model's own forward for every model")
    parser.add_argument("--mem-fraction-static", type=in_range(float, 0.001, 0.999), default=0.85,
                        help="on CUDA, the share of the free device memory (after the weights) the KV pool takes")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                        help="the KV pool's storage: auto = the model's dtype; fp8_e4m3 = one byte an entry with a "
                        "scale per head vector (paged engine core; CUDA compute capability 8.9 or newer)")
    parser.add_argument("--max-total-tokens", type=in_range(int, 64, 2**40), default=None,
                        help="the KV pool's size in tokens, instead of --mem-fraction-static (CPU default: 65,536, "
                        "at most 256 MiB); a sequence ends with finish reason length at the pool's end")
    parser.add_argument("--page-size", type=in_range(int, 1, 256), default=16,
                        help="token slots per block of the KV pool")
    parser.add_argument("--max-prefill-tokens", type=in_range(int, 16, 2**31), default=8192,
                        help="most prompt tokens one prefill step computes (a longer single prompt runs alone)")
    parser.add_argument("--cuda-graph-max-bs", type=in_range(int, 1, 512), default=256,
                        help="decode in CUDA graphs up to this many sequences")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--weight-update-root", default=None, type=nonblank,
                        help="/update_weights_from_disk loads only from paths inside this directory (relative "
                        "paths are taken from it); default: any path the server can read")
    limits = parser.add_argument_group("what one client may take (docs/serving.md)")
    limits.add_argument("--max-request-bytes", type=positive(int), default=http.max_request_bytes,
                        help="largest request body; larger ones get 413")
    limits.add_argument("--max-connections", type=positive(int), default=http.max_connections,
                        help="open connections at most; past it a new one gets 503 and is closed")
    limits.add_argument("--header-timeout-s", type=positive(float), default=http.header_timeout_s,
                        help="a request's headers must arrive within this many seconds of its first byte (else 408)")
    limits.add_argument("--body-timeout-s", type=positive(float), default=http.body_timeout_s,
                        help="a request's body must arrive within this many seconds of its headers (else 408)")
    limits.add_argument("--shutdown-grace-s", type=positive(int), default=http.shutdown_grace_s,
                        help="on SIGTERM/SIGINT, how long requests in flight may finish before they are aborted")
    limits.add_argument("--max-sequences-per-request", type=positive(int), default=work.max_sequences_per_request,
                        help="sequences (prompts x n) one request may ask for; more get 400")
    limits.add_argument("--max-tokens-per-request", type=positive(int), default=work.max_tokens_per_request,
                        help="prompt plus new tokens, summed over a request's sequences; more get 400")
    limits.add_argument("--max-inflight-sequences", type=positive(int), default=work.max_inflight_sequences,
                        help="sequences the server holds at once; a request past it gets 429 with Retry-After")
    return parser


def model_source(hf_checkpoint: str, gguf_file: str | None) -> str:
    """The folder or GGUF file the two flags name, by the training configuration's own rule (`ModelSettings`)."""
    from pydantic import ValidationError

    from relax.config.model import ModelSettings

    try:
        return ModelSettings(hf_checkpoint=hf_checkpoint, gguf_file=gguf_file).model_source
    except ValidationError as err:
        raise ValueError("; ".join(error["msg"].removeprefix("Value error, ") for error in err.errors())) from None
