"""What a distillation teacher must be: a causal LM (not a reward model folder), with the student's
tokenizer, and a context that holds what it scores.

On-policy distillation (`--teacher_pretrain`, docs/distillation.md) hands the teacher the
student's own token ids and reads its log-prob of each sampled id. That is only the teacher's
judgement of the student's text when every id means the same token to both: the same vocabulary
(every token at the same id) and the same special tokens. A teacher with another tokenizer would
score a different text, silently; it is refused before any weight is loaded. So are a reward
model folder (its value head sits where the LM head should be: the teacher's log-probs would come
from a randomly initialised head) and a teacher whose context is shorter than prompt + response.
"""

import json
from pathlib import Path

# The special tokens whose ids a run writes or reads (padding, the end of a response, the start).
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
SHOWN = 5           # differences named in a message


def tokenizer_differences(student, teacher) -> list[str]:
    """What differs between two Hugging Face tokenizers, in words (empty when they are the same):
    the vocabulary size, tokens at different ids or missing from one side, the ids of the BOS,
    EOS, pad and unknown tokens, and the added special tokens."""
    found = []
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if len(s_vocab) != len(t_vocab):
        found.append(f"the student's tokenizer has {len(s_vocab)} tokens, the teacher's {len(t_vocab)}")
    moved = [(token, s_id, t_vocab.get(token)) for token, s_id in sorted(s_vocab.items(), key=lambda kv: kv[1])
             if t_vocab.get(token) != s_id]
    missing = [token for token in t_vocab if token not in s_vocab]
    if moved:
        shown = ", ".join(f"{token!r} is id {s_id} for the student but "
                          f"{'absent' if t_id is None else f'id {t_id}'} for the teacher"
                          for token, s_id, t_id in moved[:SHOWN])
        found.append(f"{len(moved)} token(s) differ: {shown}{', ...' if len(moved) > SHOWN else ''}")
    if missing:
        found.append(f"{len(missing)} teacher token(s) are not in the student's vocabulary, e.g. "
                     f"{', '.join(map(repr, missing[:SHOWN]))}")
    for role in SPECIAL_TOKEN_ROLES:
        s_id, t_id = getattr(student, f"{role}_id", None), getattr(teacher, f"{role}_id", None)
        if s_id != t_id:
            found.append(f"the {role.replace('_', ' ')} is {getattr(student, role)!r} (id {s_id}) for the student "
                         f"but {getattr(teacher, role)!r} (id {t_id}) for the teacher")
    s_special, t_special = set(student.all_special_tokens), set(teacher.all_special_tokens)
    if s_special != t_special:
        found.append(f"the special tokens differ: only the student's {sorted(s_special - t_special)}, only the "
                     f"teacher's {sorted(t_special - s_special)}")
    return found


def check_teacher_tokenizer(student, teacher, student_what: str, teacher_what: str) -> None:
    """Refuses a teacher whose tokenizer is not the student's (`tokenizer_differences`), naming
    both (`student_what`, `teacher_what`: a flag and a folder) and what differs."""
    differences = tokenizer_differences(student, teacher)
    if differences:
        raise ValueError(f"{teacher_what}: the teacher must share the student's tokenizer ({student_what}), since it "
                         f"scores the student's own token ids, but {'; '.join(differences)}. Use a teacher of the "
                         "same model family and tokenizer (e.g. a larger or further-trained model of the student's "
                         "family)")


def weight_names(folder: str | Path) -> set[str] | None:
    """The tensor names of a model folder's safetensors weights (read from the file headers or the
    index, nothing loaded), or None when the folder has none to read (a Hub id, .bin weights)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text())["weight_map"])
        single = folder / "model.safetensors"
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                return set(f.keys())
    except (OSError, ValueError, KeyError):
        return None
    return None


def check_teacher_folder(folder: str, value_head_prefix: str, max_tokens: int | None,
                         trust_remote_code: bool = False) -> None:
    """Refuses, naming --teacher_pretrain and the fix: a reward model folder (lightrft's reward
    config, or a `value_head_prefix` head among its weights and no LM head), and a context
    (`max_position_embeddings`) shorter than `max_tokens`, the prompt + response it must score.
    A text teacher of a run with images is refused with the critic and reward models
    (`lightrft.builders.models.check_scorers_take_images`)."""
    from transformers import AutoConfig

    from lightrft.models.families import family_for

    try:
        hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return              # the model load names what is wrong with the folder
    names = weight_names(folder) or set()
    head = f"{value_head_prefix}.weight"
    if hasattr(hf_config, "normalize_reward") or (head in names and not any(n.endswith("lm_head.weight") for n in names)):
        raise ValueError(f"--teacher_pretrain {folder} is a reward model folder (a value head {head!r} in place of an "
                         "LM head): a teacher's log-probs would come from a randomly initialised LM head. Pass the "
                         "causal LM the reward model was trained from, or another causal LM with the student's "
                         "tokenizer")
    context = family_for(hf_config).context_length(hf_config)
    if max_tokens is not None and context is not None and context < max_tokens:
        raise ValueError(f"--teacher_pretrain {folder} takes {context} positions (max_position_embeddings), but it "
                         f"scores prompt + response of up to {max_tokens} tokens (--prompt_max_len + "
                         "--generate_max_len): lower those, or use a teacher with a longer context")
