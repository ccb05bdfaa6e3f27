/* A stand-in for the NVIDIA driver library (libcuda.so.1) on a machine without a GPU.
 *
 * The pip wheel of sgl_kernel is built for CUDA: importing it loads a `common_ops` library that is linked
 * against libcuda.so.1 and refers to one driver symbol, cuPointerGetAttribute. A GPU-less machine has no
 * libcuda.so.1, so `import sgl_kernel` fails before SGLang's CPU engine can start. This library satisfies
 * the dynamic linker and nothing more: every entry point answers CUDA_ERROR_NO_DEVICE (100), so any code
 * that did try the driver would see "no GPU" instead of a crash. On the CPU path (SGLANG_USE_CPU_ENGINE=1,
 * --device cpu) serving, radix-cache hits and /flush_cache never call a CUDA op; torch keeps reporting
 * torch.cuda.is_available() == False because it loads its own CUDA runtime, not this file.
 *
 * Built by `make sglang-cpu` with: cc -shared -fPIC -o libcuda.so.1 libcuda_stub.c
 */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

#define CUDA_ERROR_NO_DEVICE 100

CUresult cuInit(unsigned int flags) {
    (void)flags;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *version) {
    if (version) {
        *version = 0;
    }
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDeviceGetCount(int *count) {
    if (count) {
        *count = 0;
    }
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    (void)data;
    (void)attribute;
    (void)ptr;
    return CUDA_ERROR_NO_DEVICE;
}
