#!/usr/bin/env bash
# Builds the docs site and takes PNGs of the home page and a reference page in a headless
# chromium (Debian's: apt-get install chromium), for a look by hand at the layout.
# Usage: bash scripts/screenshot_docs.sh [OUT_DIR]   (default: site-shots/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-site-shots}
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
.venv/bin/python -m mkdocs build --strict --quiet --site-dir "$SITE"
mkdir -p "$OUT"
for page in index reference/config reference/cli guides/fine-tuning guides/online-rl; do
    name=$(echo "${page}" | tr / -)  # (use_directory_urls: false: a page is PAGE.html)
    chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1000 \
        --screenshot="$OUT/$name.png" "file://$SITE/$page.html" 2>/dev/null
    echo "$OUT/$name.png"
done
