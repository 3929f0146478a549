"""What counts as a secret: credentials are masked wherever they appear, and numbers whose names merely contain
"token" or "key" (s_per_token, cached_tokens, hold_key) are left alone, so a run's record stays usable."""

from __future__ import annotations

import pytest

from kvbench.redact import MASK, is_secret_name, redact, redact_argv, redact_text, redact_url


@pytest.mark.parametrize(
    "name", ["api_key", "OPENAI_API_KEY", "X-Api-Key", "Authorization", "hf_token", "access_token", "token",
             "client_secret", "password", "--api-key", "Cookie"],
)  # fmt: skip
def test_credential_names_are_secret(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name", ["s_per_token", "s_per_kv_token", "cached_tokens", "time_to_first_token", "max_num_batched_tokens",
             "hold_key", "api_key_env", "--api-key-env", "--header", "token_hit_rate"],
)  # fmt: skip
def test_counts_and_variable_names_are_not(name):
    assert not is_secret_name(name)


def test_urls_texts_and_command_lines_are_masked():
    assert (
        redact_url("http://u:sk-1@h:8000/v1?api_key=abc&model=m") == f"http://{MASK}@h:8000/v1?api_key={MASK}&model=m"
    )
    text = redact_text("GET http://u:pw@h/v1 failed; Authorization: Bearer sk-abcdef; api_key=xyz; cached_tokens=5")
    assert "pw" not in text and "sk-abcdef" not in text and "xyz" not in text and "cached_tokens=5" in text
    argv = ["kvbench", "replay", "--url", "http://a:b@h", "--api-key", "K", "--token=Z", "--header",
            "Authorization: Bearer sk-zzz", "--max-output-tokens", "5", "--api-key-env", "MY_KEY"]  # fmt: skip
    shown = " ".join(redact_argv(argv))
    assert not any(s in shown for s in ("a:b@", " K ", "=Z", "sk-zzz")) and "--max-output-tokens 5" in shown
    assert "--api-key-env MY_KEY" in shown  # a variable's name is not a secret


def test_records_keep_numbers_and_mask_credentials():
    record = {"url": "http://a:b@h", "api_key": "x", "s_per_token": 1e-4, "headers": {"Authorization": "Bearer x"}}
    assert redact(record) == {
        "url": f"http://{MASK}@h", "api_key": MASK, "s_per_token": 1e-4, "headers": {"Authorization": MASK},
    }  # fmt: skip
