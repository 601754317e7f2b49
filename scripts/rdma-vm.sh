#!/usr/bin/env bash
# Runs a command inside a Linux guest whose soft-RoCE device `rxe0` is up, and returns the
# command's output and exit status. The guest boots Debian's 6.1 kernel under qemu (software
# emulation: KVM guests hang on this nested host), mounts this machine's root filesystem
# read-only over 9p and chroots into it, so binaries built here run unchanged there with the
# host's libibverbs and its rxe provider. Both nodes of a test run in the one guest and reach
# each other over rxe0 (10.0.2.15 on the guest's eth0).
#
#   scripts/rdma-vm.sh [--timeout SECONDS] [--cpus N] [--mem MIB] COMMAND [ARGS...]
#
# The command runs as root in the current directory (read-only in the guest, wherever it is
# on the host) with /tmp, /run and /dev/shm as tmpfs; a file it writes under $KVF_OUT comes back in the host directory
# named by $KVF_OUT_HOST (a fresh temporary one when unset). Packages, the kernel and the
# initramfs are cached in ${KVFERRY_CACHE:-~/.cache/kvferry}/vm; a missing package is
# installed, never skipped.
set -euo pipefail

timeout_s=600
cpus=2
mem=3072
while [ $# -gt 0 ]; do
    case "$1" in
        --timeout) timeout_s=$2; shift 2 ;;
        --cpus) cpus=$2; shift 2 ;;
        --mem) mem=$2; shift 2 ;;
        --) shift; break ;;
        *) break ;;
    esac
done
if [ $# -eq 0 ]; then
    echo "usage: $0 [--timeout S] [--cpus N] [--mem MIB] COMMAND [ARGS...]" >&2
    exit 2
fi

cache=${KVFERRY_CACHE:-$HOME/.cache/kvferry}/vm
mkdir -p "$cache"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"

# -- packages: qemu and the guest's tools (gdb for the stacks of a stalled run), rdma-core for the
# command (installed, never skipped)
need=()
for pkg in qemu-system-x86 busybox-static cpio kmod iproute2 rdma-core ibverbs-providers \
    ibverbs-utils perftest gdb; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "rdma-vm: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# -- the kernel: the 6.1 image Debian's linux-image-amd64 depends on, unpacked, never installed
kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-6/ {print $2; exit}')
kver=${kpkg#linux-image-}
kdir="$cache/$kpkg"
if [ ! -f "$kdir/boot/vmlinuz-$kver" ]; then
    echo "rdma-vm: fetching $kpkg" >&2
    rm -rf "$kdir" "$cache"/*.deb
    (cd "$cache" && apt-get download "$kpkg" 2>/dev/null)
    dpkg -x "$cache/${kpkg}"_*.deb "$kdir"
    rm -f "$cache/${kpkg}"_*.deb
fi

# -- the initramfs: busybox, the modules rxe needs (in dependency order), and /init
modules="crc32_generic virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci
failover net_failover virtio_net netfs fscache 9pnet 9pnet_virtio 9p ib_core ib_uverbs
udp_tunnel ip6_udp_tunnel rdma_rxe veth sch_netem tun"
initrd="$cache/initrd-$kver-$(sha256sum "$0" | cut -c1-12).gz"
if [ ! -f "$initrd" ]; then
    root=$(mktemp -d)
    mkdir -p "$root"/{bin,proc,sys,dev,host,modules}
    cp /bin/busybox "$root/bin/busybox"
    for m in $modules; do
        ko=$(find "$kdir/lib/modules/$kver" -name "$m.ko" | head -1)
        [ -n "$ko" ] || { echo "rdma-vm: module $m missing from $kpkg" >&2; exit 1; }
        cp "$ko" "$root/modules/"
    done
    echo $modules > "$root/modules/order"
    cat > "$root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules/order); do
    insmod /modules/$m.ko || echo "rdma-vm: insmod $m failed"
done
o=trans=virtio,version=9p2000.L,msize=1048576
# The read-only mounts keep what they read (cache=loose): nothing on the host changes them
# while the guest runs, and without it every process re-read its libraries over 9p.
mount -t 9p -o $o,ro,cache=loose hostroot /host || echo "rdma-vm: no host root"
for d in tmp run dev/shm; do mount -t tmpfs tmpfs /host/$d; done
mount -t proc proc /host/proc
mount -t sysfs sysfs /host/sys
mount -t devtmpfs devtmpfs /host/dev
mkdir -p /host/dev/shm /host/tmp/kvf-out
mount -t tmpfs tmpfs /host/dev/shm
ln -sf /proc/self/fd /host/dev/fd
for i in 0 1 2; do ln -sf /proc/self/fd/$i /host/dev/$(echo stdin stdout stderr | cut -d' ' -f$((i + 1))); done
mount -t 9p -o $o kvfout /host/tmp/kvf-out
# The command's directory, shared on its own: it may sit under /tmp or /run, which the
# tmpfs mounts above hide.
cwd=$(cat /host/tmp/kvf-out/cwd)
mkdir -p "/host$cwd" 2>/dev/null
mount -t 9p -o $o,ro,cache=loose kvfcwd "/host$cwd" || echo "rdma-vm: cannot mount $cwd"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp
chroot /host /bin/sh -c 'ip link set lo up && ip addr add 10.0.2.15/24 dev eth0 &&
    ip link set eth0 up && rdma link add rxe0 type rxe netdev eth0' ||
    echo "rdma-vm: could not bring rxe0 up"
echo "@@kvf-vm-begin@@"
chroot /host /bin/sh /tmp/kvf-out/cmd.sh </dev/null
rc=$?
echo "@@kvf-vm-end@@"
echo $rc > /host/tmp/kvf-out/rc
sync
poweroff -f
INIT
    chmod +x "$root/init"
    (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$initrd.tmp"
    mv "$initrd.tmp" "$initrd"
    rm -rf "$root"
fi

# -- run
out=${KVF_OUT_HOST:-$(mktemp -d /tmp/kvf-vm.XXXXXX)}
mkdir -p "$out"
rm -f "$out/rc"
printf '%s' "$PWD" > "$out/cwd"
{
    echo "export KVF_OUT=/tmp/kvf-out PATH=$PATH HOME=/tmp"
    for v in $(env | grep -oE '^(KVFERRY|RUST|CARGO_TERM)[A-Z_]*' || true); do
        printf 'export %s=%q\n' "$v" "${!v}"
    done
    printf 'cd %q || exit 125\n' "$PWD"
    printf '%q ' "$@"
    echo
} > "$out/cmd.sh"
accel="tcg,thread=multi"
set +e
timeout --foreground "$timeout_s" qemu-system-x86_64 \
    -accel "$accel" -cpu max -smp "$cpus" -m "$mem" \
    -nographic -no-reboot -monitor none -serial stdio \
    -kernel "$kdir/boot/vmlinuz-$kver" -initrd "$initrd" \
    -append "console=ttyS0 quiet loglevel=1 panic=-1" \
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0,romfile= \
    -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
    -virtfs "local,path=$out,mount_tag=kvfout,security_model=none" \
    -virtfs "local,path=$PWD,mount_tag=kvfcwd,security_model=none,readonly=on,multidevs=remap" \
    </dev/null | tr -d '\r' | awk '
        /@@kvf-vm-begin@@/ { on = 1; next }
        /@@kvf-vm-end@@/ { on = 0; next }
        on || /rdma-vm:|Kernel panic|Out of memory/ { print; fflush() }'
qemu=${PIPESTATUS[0]}
set -e
if [ ! -f "$out/rc" ]; then
    echo "rdma-vm: the guest ended without the command's status (qemu exit $qemu; timeout ${timeout_s}s)" >&2
    exit 124
fi
exit "$(cat "$out/rc")"
