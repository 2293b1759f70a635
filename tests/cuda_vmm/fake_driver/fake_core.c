/* Initialisation, devices, primary contexts, error names, the symbol table and the call log.
 *
 * Rules: every call but cuGetProcAddress_v2, cuDriverGetVersion and
 * cuGetErrorName needs cuInit first (CUDA_ERROR_NOT_INITIALIZED). A primary
 * context is live between cuDevicePrimaryCtxRetain and the matching release;
 * the current context is per thread (cuCtxSetCurrent), and the calls that need
 * one fail with CUDA_ERROR_INVALID_CONTEXT on a thread without a live one.
 *
 * The log: when FAKE_CUDA_LOG names a file at cuInit, each call appends one
 * line "pid<TAB>tid<TAB>context<TAB>name<TAB>result<TAB>detail" with a single
 * write(2), so lines of several threads and processes never interleave.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fake_cuda.h"

static pthread_mutex_t state_mutex = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int log_fd = -1;
static size_t total_bytes = FAKE_DEFAULT_TOTAL_BYTES;

struct fake_context { int device; int refcount; };
static struct fake_context primary[FAKE_NUM_DEVICES];
static __thread struct fake_context *current;

void fake_lock(void) { pthread_mutex_lock(&state_mutex); }
void fake_unlock(void) { pthread_mutex_unlock(&state_mutex); }
int fake_initialized(void) { return initialized; }
CUcontext fake_current_context(void) { return current; }
size_t fake_total_bytes(void) { return total_bytes; }

CUresult fake_need_context(void)
{
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (current == NULL || __atomic_load_n(&current->refcount, __ATOMIC_SEQ_CST) <= 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

void fake_log(const char *name, CUresult result, const char *fmt, ...)
{
    if (log_fd < 0)
        return;
    char detail[160] = "";
    va_list args;
    va_start(args, fmt);
    vsnprintf(detail, sizeof detail, fmt, args);
    va_end(args);
    char line[320];
    int len = snprintf(line, sizeof line, "%d\t%ld\t%p\t%s\t%d\t%s\n", (int)getpid(),
                       (long)syscall(SYS_gettid), (void *)current, name, result, detail);
    if (len > 0)
        (void)!write(log_fd, line, (size_t)len < sizeof line ? (size_t)len : sizeof line - 1);
}

CUresult cuInit(unsigned int flags)
{
    CUresult r = flags ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    fake_lock();
    if (r == CUDA_SUCCESS && !initialized) {
        const char *path = getenv("FAKE_CUDA_LOG");
        if (path && *path)
            log_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
        const char *total = getenv("FAKE_CUDA_TOTAL_BYTES");
        if (total && *total)
            total_bytes = strtoull(total, NULL, 10);
        for (int d = 0; d < FAKE_NUM_DEVICES; d++)
            primary[d].device = d;
        initialized = 1;
    }
    fake_unlock();
    fake_log("cuInit", r, "flags=%u", flags);
    return r;
}

CUresult cuDriverGetVersion(int *version)
{
    if (version == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *version = FAKE_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
    CUresult r = initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
    if (r == CUDA_SUCCESS)
        *count = FAKE_NUM_DEVICES;
    fake_log("cuDeviceGetCount", r, "-");
    return r;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult r = !initialized ? CUDA_ERROR_NOT_INITIALIZED
               : (ordinal < 0 || ordinal >= FAKE_NUM_DEVICES) ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        *device = ordinal;
    fake_log("cuDeviceGet", r, "ordinal=%d", ordinal);
    return r;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice device)
{
    CUresult r = !initialized ? CUDA_ERROR_NOT_INITIALIZED
               : (device < 0 || device >= FAKE_NUM_DEVICES) ? CUDA_ERROR_INVALID_DEVICE
               : (name == NULL || len <= 0) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        snprintf(name, (size_t)len, "%s", FAKE_DEVICE_NAME);
    fake_log("cuDeviceGetName", r, "device=%d", device);
    return r;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device)
{
    CUresult r = !initialized ? CUDA_ERROR_NOT_INITIALIZED
               : (device < 0 || device >= FAKE_NUM_DEVICES) ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS) {
        __atomic_add_fetch(&primary[device].refcount, 1, __ATOMIC_SEQ_CST);
        *ctx = &primary[device];
    }
    fake_log("cuDevicePrimaryCtxRetain", r, "device=%d", device);
    return r;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice device)
{
    CUresult r = !initialized ? CUDA_ERROR_NOT_INITIALIZED
               : (device < 0 || device >= FAKE_NUM_DEVICES) ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS && __atomic_sub_fetch(&primary[device].refcount, 1, __ATOMIC_SEQ_CST) < 0) {
        __atomic_add_fetch(&primary[device].refcount, 1, __ATOMIC_SEQ_CST);
        r = CUDA_ERROR_INVALID_CONTEXT;
    }
    fake_log("cuDevicePrimaryCtxRelease", r, "device=%d", device);
    return r;
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult r = !initialized ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_CONTEXT;
    if (initialized && ctx == NULL)
        r = CUDA_SUCCESS;
    for (int d = 0; initialized && d < FAKE_NUM_DEVICES; d++)
        if (ctx == &primary[d])
            r = CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        current = ctx;
    fake_log("cuCtxSetCurrent", r, "ctx=%p", ctx);
    return r;
}

CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    CUresult r = initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
    if (r == CUDA_SUCCESS)
        *ctx = current;
    fake_log("cuCtxGetCurrent", r, "-");
    return r;
}

static const struct { CUresult code; const char *name; } error_names[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
};

CUresult cuGetErrorName(CUresult error, const char **name)
{
    for (size_t i = 0; i < sizeof error_names / sizeof error_names[0]; i++) {
        if (error_names[i].code == error) {
            *name = error_names[i].name;
            return CUDA_SUCCESS;
        }
    }
    *name = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **text)
{
    return cuGetErrorName(error, text);
}

/* The entry points of fake_vmm.c and fake_copy.c, for the table below. */
CUresult cuMemGetAllocationGranularity(size_t *, const CUmemAllocationProp *, int);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle, int, unsigned long long);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *, void *, int);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemGetInfo(size_t *, size_t *);
CUresult cuPointerGetAttribute(void *, int, CUdeviceptr);
CUresult cuCtxSynchronize(void);
CUresult cuMemHostRegister(void *, size_t, unsigned int);
CUresult cuMemHostUnregister(void *);
CUresult cuMemcpyDtoH(void *, CUdeviceptr, size_t);
CUresult cuMemcpyHtoD(CUdeviceptr, const void *, size_t);
CUresult cuMemsetD8(CUdeviceptr, unsigned char, size_t);
CUresult cuMemsetD32(CUdeviceptr, unsigned int, size_t);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamDestroy(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuMemcpyDtoHAsync(void *, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyHtoDAsync(CUdeviceptr, const void *, size_t, CUstream);

#define ENTRY(fn) {#fn, (void *)fn}
static const struct { const char *name; void *fn; } symbols[] = {
    ENTRY(cuInit), ENTRY(cuDriverGetVersion), ENTRY(cuDeviceGetCount), ENTRY(cuDeviceGet),
    ENTRY(cuDeviceGetName), ENTRY(cuDevicePrimaryCtxRetain), ENTRY(cuDevicePrimaryCtxRelease),
    ENTRY(cuCtxSetCurrent), ENTRY(cuCtxGetCurrent), ENTRY(cuCtxSynchronize), ENTRY(cuGetErrorName),
    ENTRY(cuGetErrorString), ENTRY(cuMemGetAllocationGranularity), ENTRY(cuMemAddressReserve),
    ENTRY(cuMemAddressFree), ENTRY(cuMemCreate), ENTRY(cuMemRelease),
    ENTRY(cuMemExportToShareableHandle), ENTRY(cuMemImportFromShareableHandle), ENTRY(cuMemMap),
    ENTRY(cuMemSetAccess), ENTRY(cuMemUnmap), ENTRY(cuMemGetInfo), ENTRY(cuPointerGetAttribute),
    ENTRY(cuMemHostRegister), ENTRY(cuMemHostUnregister), ENTRY(cuMemcpyDtoH), ENTRY(cuMemcpyHtoD),
    ENTRY(cuMemsetD8), ENTRY(cuMemsetD32), ENTRY(cuStreamCreate), ENTRY(cuStreamDestroy),
    ENTRY(cuStreamSynchronize), ENTRY(cuMemcpyDtoHAsync), ENTRY(cuMemcpyHtoDAsync),
};

/* How cuda-bindings finds every driver function: by base name, whatever the version asked. */
CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, unsigned long long flags,
                             int *status)
{
    (void)version;
    (void)flags;
    for (size_t i = 0; symbol && i < sizeof symbols / sizeof symbols[0]; i++) {
        if (strcmp(symbols[i].name, symbol) == 0) {
            *fn = symbols[i].fn;
            if (status)
                *status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
            return CUDA_SUCCESS;
        }
    }
    *fn = NULL;
    if (status)
        *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}
