# Shared by bench/gpu_make_test.sh and bench/peer/prepare.sh + run.sh (sourced, not run): one
# big file carried to the device machine in pieces, one piece a device call (64 MiB a call,
# working tree included). Each call's carry replaces the pieces folder there, so every call
# copies its piece out to /tmp first (wp_stash), and the last call joins and checks them.
#
#   wp_split FILE DIR FIRST_MB PART_MB   # here: DIR/a/part (FIRST_MB), DIR/b/part, ... (PART_MB
#                                        # each), DIR/a/sha256 (of FILE); prints the sizes
#   wp_stash DIR DEST                    # there, every call: DIR/* to DEST/ (DEST/a, DEST/b...)
#   wp_join DEST OUT                     # there, last: DEST/*/part joined into OUT, sha256 checked

wp_split() {
  local file=$1 dir=$2 first_mb=$3 part_mb=$4
  rm -rf "$dir" && mkdir -p "$dir/a"
  dd if="$file" of="$dir/a/part" bs=1M count="$first_mb" status=none
  local total off name
  total=$(stat -c %s "$file"); off=$((first_mb * 1048576))
  for name in b c d e f g h i j k l m n o p; do
    [ "$off" -lt "$total" ] || break
    mkdir -p "$dir/$name"
    dd if="$file" of="$dir/$name/part" bs=1M skip=$((off / 1048576)) count="$part_mb" status=none
    off=$((off + part_mb * 1048576))
  done
  [ "$off" -ge "$total" ] || { echo "wp_split: $file needs more than 15 pieces" >&2; return 1; }
  sha256sum "$file" | cut -d' ' -f1 >"$dir/a/sha256"
  du -sh "$dir"/*
}

wp_stash() {
  mkdir -p "$2" && cp -r "$1"/* "$2"/ && ls "$2"
}

wp_join() {
  local dest=$1 out=$2
  cat "$dest"/*/part >"$out"
  if [ "$(sha256sum "$out" | cut -d' ' -f1)" != "$(cat "$dest/a/sha256" 2>/dev/null)" ]; then
    echo "pieces missing or corrupt: $(ls "$dest")" >&2
    return 1
  fi
}
