#!/usr/bin/env bash
# Run HERE (Debian bookworm, with apt). Fetches the Debian packages dsrun needs besides libtorch and
# unpacks them into .device/sysroot/<group>/usr, one prefix per library so that no library's headers
# shadow another's (fmt 9 and gloo must never sit beside PyTorch's own copies). The GPU machine has
# no package registry: carry .device there and build with scripts/gpu_build.sh.
# Idempotent: skips the download when .device/sysroot/.stamp already lists the same packages.
# Usage: scripts/gpu_kit.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."

sysroot=.device/sysroot
# group:package... ; every group becomes the prefix .device/sysroot/<group>/usr.
groups=(
  "tomlplusplus:libtomlplusplus-dev libtomlplusplus3"
  "fmt:libfmt-dev libfmt9"
  "spdlog:libspdlog-dev libspdlog1.10"
  "cli11:libcli11-dev"
  "sqlite3:libsqlite3-dev libsqlite3-0"
  "catch2:catch2"
  "nlohmann_json:nlohmann-json3-dev"
  "lua:liblua5.4-dev liblua5.4-0"     # recipe hooks
  "xxhash:libxxhash-dev libxxhash0"   # checkpoint checksums
  "gloo:libgloo-dev"          # headers only; gpu_build.sh uses them only if torch ships none
  "pcre2:libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3"  # tokenizer regexes
  "utf8proc:libutf8proc-dev libutf8proc2"                                       # Unicode normalisation
  "sentencepiece:libsentencepiece-dev libsentencepiece0 libprotobuf-lite32"     # tokenizer.model files
  "zstd:libzstd-dev libzstd1"                                                   # dsrun prepare reads .zst
  "zlib:zlib1g-dev zlib1g"                                                      # dsrun prepare reads .gz
  "pkgconf:pkgconf-bin libpkgconf3"  # used only if the GPU machine has no pkg-config
  "fortunes:fortunes fortunes-min"   # data: recipes/quickstart.toml trains on /usr/share/games/fortunes
)

all=()
for g in "${groups[@]}"; do read -ra p <<<"${g#*:}"; all+=("${p[@]}"); done

# Versions apt would fetch now: the stamp records them, so a changed candidate re-runs the kit.
if ! apt-cache show "${all[@]}" >/dev/null 2>&1; then
  echo "gpu_kit: apt lists lack some packages; running apt-get update"
  apt-get update -qq
fi
want=$(for p in "${all[@]}"; do echo "$p $(apt-cache policy "$p" | awk '/Candidate:/ {print $2}')"; done)

if [ "${1:-}" != "--force" ] && [ -f "$sysroot/.stamp" ] && [ "$(cat "$sysroot/.stamp")" = "$want" ]; then
  echo "gpu_kit: $sysroot is up to date (scripts/gpu_kit.sh --force to redo)"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # As root, apt-get download would hand the files to its _apt user, who cannot write in $tmp.
  (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "${all[@]}" >/dev/null)
  rm -rf "$sysroot"
  for g in "${groups[@]}"; do
    name=${g%%:*}
    read -ra pkgs <<<"${g#*:}"
    mkdir -p "$sysroot/$name"
    for p in "${pkgs[@]}"; do
      deb=$(ls "$tmp/${p}_"*.deb)
      dpkg-deb -x "$deb" "$sysroot/$name"
    done
    rm -rf "$sysroot/$name/usr/share/doc" "$sysroot/$name/usr/share/man" "$sysroot/$name/usr/share/doc-base" \
           "$sysroot/$name/usr/share/lintian"
  done

  # gloo: keep the headers alone (its .so symlink would dangle: libgloo0 is not fetched).
  find "$sysroot/gloo" -mindepth 1 -maxdepth 2 ! -path "$sysroot/gloo/usr" ! -path "$sysroot/gloo/usr/include" \
    -exec rm -rf {} +

  # .pc files name /usr; make them relative to where they lie (usr/lib/<arch>/pkgconfig or usr/share/pkgconfig).
  while IFS= read -r pc; do
    case "$pc" in */lib/x86_64-linux-gnu/pkgconfig/*) up='${pcfiledir}/../../..' ;; *) up='${pcfiledir}/../..' ;; esac
    sed -i -E -e "s|^prefix=/usr\$|prefix=$up|" -e 's|^([a-z_]+)=/usr(/.*)?$|\1=${prefix}\2|' \
              -e "s|-I/usr/include|-I$up/include|g" "$pc"
  done < <(find "$sysroot" -path '*/pkgconfig/*.pc')

  # Debian's luaconf.h includes "lua5.4-deb-multiarch.h", which lives in the multiarch include
  # directory (a default path on Debian, not elsewhere); beside luaconf.h the quoted include finds it.
  cp "$sysroot"/lua/usr/include/x86_64-linux-gnu/lua5.4-deb-multiarch.h "$sysroot"/lua/usr/include/lua5.4/

  # zlib1g lives in /lib and zlib1g-dev's libz.so names it absolutely: point it at the unpacked copy.
  while IFS= read -r link; do
    group=${link#"$sysroot"/}; group=${group%%/*}
    target="$sysroot/$group$(readlink "$link")"
    if [ -e "$target" ]; then ln -sfr "$target" "$link"; fi
  done < <(find "$sysroot" -type l -lname '/*')

  # No absolute symlinks may remain: they would point into the GPU machine's own /usr.
  if abs=$(find "$sysroot" -type l -lname '/*' -print) && [ -n "$abs" ]; then
    echo "gpu_kit: absolute symlinks left:"; echo "$abs"; exit 1
  fi
  echo "$want" >"$sysroot/.stamp"
fi

# Every header and library gpu_build.sh relies on.
missing=0
for f in tomlplusplus/usr/include/toml++/toml.h spdlog/usr/include/spdlog/spdlog.h fmt/usr/include/fmt/format.h \
         cli11/usr/include/CLI/CLI.hpp sqlite3/usr/include/sqlite3.h catch2/usr/include/catch2/catch.hpp \
         nlohmann_json/usr/include/nlohmann/json.hpp gloo/usr/include/gloo/algorithm.h \
         lua/usr/include/lua5.4/lua.h xxhash/usr/include/xxhash.h \
         tomlplusplus/usr/lib/x86_64-linux-gnu/libtomlplusplus.so.3 spdlog/usr/lib/x86_64-linux-gnu/libspdlog.so.1.10 \
         fmt/usr/lib/x86_64-linux-gnu/libfmt.so.9 sqlite3/usr/lib/x86_64-linux-gnu/libsqlite3.so.0 \
         sqlite3/usr/lib/x86_64-linux-gnu/pkgconfig/sqlite3.pc pkgconf/usr/bin/pkgconf \
         fortunes/usr/share/games/fortunes/fortunes; do
  [ -e "$sysroot/$f" ] || { echo "gpu_kit: missing $sysroot/$f"; missing=1; }
done
[ "$missing" -eq 0 ] || exit 1
echo "gpu_kit: $(du -sh .device | cut -f1) in .device ($(find .device -type f | wc -l) files); carry \".device\" to the GPU machine"
