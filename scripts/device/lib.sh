# Sourced by wgpu.sh and cuda.sh: finds what to run (the executables of scripts/device/pack.sh,
# or cargo where the machine has it) and makes the lent machine's libraries reachable.
# Expects to run from the repository root; defines `pack`, `have_pack`, `bin` (the pack's
# executables, an absolute path) and the functions below.

pack="${ROLLOUTPIPE_DEVICE_PACK:-target/device-pack}"
have_pack=0
bin=
if [ -x "$pack/bin/conformance" ]; then
  have_pack=1
  bin="$(cd "$pack/bin" && pwd)"
fi

# A step's timeout: `n` seconds, or what is left before ROLLOUTPIPE_DEVICE_DEADLINE (epoch
# seconds, set by all.sh so that both scripts fit one device call) when that is less; at least 1.
limit() {
  local n=$1 rem
  if [ -n "${ROLLOUTPIPE_DEVICE_DEADLINE:-}" ]; then
    rem=$((ROLLOUTPIPE_DEVICE_DEADLINE - $(date +%s)))
    [ "$rem" -lt "$n" ] && n=$rem
  fi
  [ "$n" -lt 1 ] && n=1
  echo "$n"
}

# Says what will run; fails in one line when there is neither a pack nor cargo.
device_runner() {
  if [ "$have_pack" = 1 ]; then
    echo "running the executables of $pack ($(head -1 "$pack/MANIFEST" 2>/dev/null || echo 'no MANIFEST'))"
  elif command -v cargo >/dev/null; then
    echo "no $pack: building with cargo"
  else
    echo "$(basename "$0"): neither $pack nor cargo is here: run scripts/device/pack.sh on a machine that builds the project and carry target/device-pack" >&2
    return 2
  fi
}

# The driver's own libraries (libcuda.so.1, and libGLX_nvidia.so.0 that NVIDIA's Vulkan manifest
# names) under its mount, on LD_LIBRARY_PATH where the image does not already list them.
nvidia_lib_path() {
  local d
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    [ -d "$d" ] || continue
    case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d" ;; esac
  done
}

# wgpu needs the Vulkan loader (libvulkan.so.1) and a driver manifest. The lent machine's image
# may have neither: unpack the pack's Debian libvulkan1 and point the loader at NVIDIA's manifest
# under the driver's mount, as /work/.library/device/README.md describes.
setup_vulkan() {
  nvidia_lib_path
  if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1 '; then
    local deb
    for deb in "$pack"/debs/libvulkan1_*.deb; do
      [ -e "$deb" ] || continue
      echo "unpacking $(basename "$deb") (no Vulkan loader on this machine)"
      dpkg -x "$deb" / && ldconfig
    done
  fi
  local nv=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ] && [ -e "$nv" ] \
    && ! ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
    export VK_DRIVER_FILES="$nv"
    echo "VK_DRIVER_FILES=$nv"
  fi
  if [ -z "${__EGL_VENDOR_LIBRARY_FILENAMES:-}" ] && [ -e /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json ]; then
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  fi
  ldconfig -p 2>/dev/null | grep -m1 'libvulkan\.so\.1 ' || echo "no libvulkan.so.1 on this machine: wgpu can only find a GL adapter"
  # On an NVIDIA machine, Vulkan: wgpu could otherwise also find the same GPU through EGL.
  if [ -z "${WGPU_BACKEND:-}" ] && command -v nvidia-smi >/dev/null; then
    export WGPU_BACKEND=vulkan
    echo "WGPU_BACKEND=vulkan"
  fi
}

# cudarc loads the driver, cuBLAS and NVRTC at run time by names such as libcublas.so or
# libcublas.so.12. A CUDA 13 machine may have only libcublas.so.13 (under the toolkit or
# PyTorch's nvidia-* wheels): link each library it finds under an unversioned name in a private
# folder and put that folder, and the libraries' own, on LD_LIBRARY_PATH.
setup_cuda_libs() {
  local dir=/tmp/rolloutpipe-cuda-libs lib found d
  nvidia_lib_path
  mkdir -p "$dir"
  for lib in cublas cublasLt nvrtc; do
    found=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt -name "lib$lib.so*" \
      \( -type f -o -type l \) 2>/dev/null | sort -V | tail -1)
    if [ -n "$found" ]; then
      ln -sf "$found" "$dir/lib$lib.so"
      d=$(dirname "$found")
      case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
      echo "lib$lib.so -> $found"
    else
      echo "lib$lib.so not found on this machine"
    fi
  done
  export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
