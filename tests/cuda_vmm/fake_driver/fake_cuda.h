/* A test double of libcuda.so.1: the driver calls kvdaemon makes, over host memory.
 *
 * Shared declarations of the three parts: fake_core.c (initialisation, devices,
 * contexts, error names, the symbol table cuda-bindings reads through
 * cuGetProcAddress_v2, the call log), fake_vmm.c (reservations, allocations,
 * export/import, map/unmap/access, pointer attributes) and fake_copy.c (copies,
 * memsets, host registration, synchronisation).
 *
 * Model: "device memory" is host memory. A reservation is a PROT_NONE mapping;
 * an allocation is a memfd (filled with garbage, as a reused GPU page may be);
 * an exported handle is a dup of the memfd; cuMemMap maps the memfd at the
 * address with no access, and cuMemSetAccess opens it. A device pointer is the
 * host address, so a CPU tensor over a mapped address reads what a kernel
 * would. Every state change holds one process-wide mutex.
 */
#ifndef KVD_FAKE_CUDA_H
#define KVD_FAKE_CUDA_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct fake_stream *CUstream;  /* NULL: the default stream */

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

/* Enum values and struct layouts as cuda.h defines them (checked against cuda-bindings 13). */
enum { MEM_ALLOCATION_TYPE_PINNED = 1, MEM_LOCATION_TYPE_DEVICE = 1, MEM_HANDLE_TYPE_POSIX_FD = 1 };
enum { ACCESS_NONE = 0, ACCESS_READ = 1, ACCESS_READWRITE = 3 };
enum { PTR_ATTR_CONTEXT = 1, PTR_ATTR_MEMORY_TYPE = 2, PTR_ATTR_DEVICE_POINTER = 3,
       PTR_ATTR_DEVICE_ORDINAL = 9, PTR_ATTR_RANGE_START = 11, PTR_ATTR_RANGE_SIZE = 12,
       PTR_ATTR_MAPPED = 13 };
enum { MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2 };

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

#define FAKE_NUM_DEVICES 1
#define FAKE_GRANULARITY ((size_t)2 << 20)
#define FAKE_DEVICE_NAME "kvdaemon fake CUDA device (host memory)"
#define FAKE_MEMFD_NAME "kvd-fake-cuda"
#define FAKE_DRIVER_VERSION 13000
#define FAKE_DEFAULT_TOTAL_BYTES ((size_t)1 << 30)

/* fake_core.c */
void fake_lock(void);
void fake_unlock(void);
int fake_initialized(void);
CUcontext fake_current_context(void);
CUresult fake_need_context(void);           /* INVALID_CONTEXT unless this thread has a live one */
size_t fake_total_bytes(void);
void fake_log(const char *name, CUresult result, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* fake_vmm.c */
int fake_range_has_access(uintptr_t addr, size_t size, int need_write);

/* fake_copy.c */
int fake_is_registered(uintptr_t addr, size_t size); /* call with the lock held */

#endif
