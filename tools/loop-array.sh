#!/bin/bash
# RAM-backed loop devices with ext4, mounted: a stand-in for an array of fast NVMe drives, to
# measure the file tier's own ceiling against fio on the same devices (Linux, root).
#   bash tools/loop-array.sh up N [SIZE] [BASE]   make N devices of SIZE (default 6G) from files in
#                                                 /dev/shm, mount them at BASE/d0 .. BASE/d{N-1}
#                                                 (default BASE /mnt/tcarray); prints the mount points
#   bash tools/loop-array.sh down [BASE]          unmount them, detach the loop devices, delete the files
#   bash tools/loop-array.sh status [BASE]        what is mounted under BASE
# The backing files take SIZE of memory each once written: N x SIZE must fit /dev/shm.
# LOOP_FS=xfs makes XFS instead of ext4 (mkfs.xfs from xfsprogs; MKFS_XFS names another binary).
set -euo pipefail
cmd=${1:-}
case "$cmd" in
up)
  n=${2:?usage: loop-array.sh up N [SIZE] [BASE]}
  size=${3:-6G}
  base=${4:-/mnt/tcarray}
  [ "$(id -u)" = 0 ] || { echo "loop-array.sh: needs root (losetup, mkfs, mount)" >&2; exit 2; }
  mkdir -p "$base"
  for i in $(seq 0 $((n - 1))); do
    img=/dev/shm/tcarray-$(basename "$base")-d$i.img  # one backing file per base: never two file systems on one
    mnt=$base/d$i
    if mountpoint -q "$mnt"; then echo "$mnt"; continue; fi
    truncate -s "$size" "$img"
    dev=$(losetup -f --show "$img")
    # no lazy init: the first runs would otherwise share the device with ext4's own zeroing
    if [ "${LOOP_FS:-ext4}" = xfs ]; then
      "${MKFS_XFS:-mkfs.xfs}" -q -f "$dev"
    else
      mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev"
    fi
    mkdir -p "$mnt"
    mount -o noatime "$dev" "$mnt"
    chmod 700 "$mnt"
    echo "$mnt"
  done ;;
down)
  base=${2:-/mnt/tcarray}
  for mnt in "$base"/d*; do
    [ -d "$mnt" ] || continue
    if mountpoint -q "$mnt"; then
      dev=$(findmnt -n -o SOURCE "$mnt")
      umount "$mnt"
      losetup -d "$dev" 2>/dev/null || true
    fi
    rmdir "$mnt" 2>/dev/null || true
  done
  # loop devices left attached to our files (a mount that failed half-way)
  tag=tcarray-$(basename "$base")
  { losetup -a | grep -o "^/dev/loop[0-9]*:.*$tag-d[0-9]*\.img" || true; } | cut -d: -f1 | while read -r dev; do
    losetup -d "$dev" 2>/dev/null || true
  done
  rm -f /dev/shm/"$tag"-d*.img ;;
status)
  base=${2:-/mnt/tcarray}
  found=0
  for mnt in "$base"/d*; do
    if mountpoint -q "$mnt" 2>/dev/null; then findmnt -n -o TARGET,SOURCE,SIZE,USED "$mnt"; found=1; fi
  done
  [ $found = 1 ] || echo "nothing mounted under $base" ;;
*)
  echo "usage: loop-array.sh up N [SIZE] [BASE] | down [BASE] | status [BASE]" >&2; exit 2 ;;
esac
