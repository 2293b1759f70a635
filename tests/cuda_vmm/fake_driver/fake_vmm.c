/* The virtual-memory calls: reservations, allocations, export/import, map/unmap/access.
 *
 * Rules kept (each refusal changes nothing): every call here but
 * cuPointerGetAttribute needs a live current context; sizes and addresses are
 * multiples of the 2 MiB granularity; a mapping lies inside one reservation
 * and overlaps no other; a new mapping has no access until cuMemSetAccess
 * (touching it faults); cuMemSetAccess and cuMemUnmap take a range made of
 * whole mappings, all present; a released allocation can no longer be mapped
 * or exported, and lives until its last mapping goes; a reservation is freed
 * whole and empty; cuPointerGetAttribute answers for mapped addresses (and
 * registered host memory) and fails with CUDA_ERROR_INVALID_VALUE elsewhere,
 * reserved but unmapped addresses included.
 *
 * Cost: O(number of mappings) per call (linear scans); tests hold hundreds.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fake_cuda.h"

struct allocation { int fd; size_t size; int released; int num_maps; int exportable; int created; };
struct reservation { uintptr_t base; size_t size; };
struct mapping { uintptr_t addr; size_t size; CUmemGenericAllocationHandle handle; int access; };

static struct allocation *allocs;         /* handle h is allocs[h - 1]; fd < 0 once destroyed */
static size_t num_allocs, cap_allocs;
static struct reservation *resvs;
static size_t num_resvs, cap_resvs;
static struct mapping *maps;
static size_t num_maps, cap_maps;
static size_t created_bytes;

static int grow(void **array, size_t *cap, size_t count, size_t item)
{
    if (count < *cap)
        return 1;
    size_t next = *cap ? 2 * *cap : 64;
    void *bigger = realloc(*array, next * item);
    if (bigger == NULL)
        return 0;
    *array = bigger;
    *cap = next;
    return 1;
}

static int aligned(uintptr_t value) { return value % FAKE_GRANULARITY == 0; }

static struct allocation *find_alloc(CUmemGenericAllocationHandle h)
{
    if (h == 0 || h > num_allocs || allocs[h - 1].fd < 0)
        return NULL;
    return &allocs[h - 1];
}

static void destroy_if_unused(struct allocation *a)
{
    if (a->released && a->num_maps == 0) {
        close(a->fd);
        a->fd = -1;
        if (a->created)
            created_bytes -= a->size;
    }
}

static struct reservation *reservation_of(uintptr_t addr, size_t size)
{
    for (size_t i = 0; i < num_resvs; i++)
        if (addr >= resvs[i].base && addr + size <= resvs[i].base + resvs[i].size)
            return &resvs[i];
    return NULL;
}

static struct mapping *mapping_at(uintptr_t addr)    /* the mapping holding addr, or NULL */
{
    for (size_t i = 0; i < num_maps; i++)
        if (addr >= maps[i].addr && addr < maps[i].addr + maps[i].size)
            return &maps[i];
    return NULL;
}

/* 1 when [addr, addr + size) is exactly a run of whole mappings. */
static int whole_mappings(uintptr_t addr, size_t size)
{
    uintptr_t cursor = addr, end = addr + size;
    while (cursor < end) {
        struct mapping *m = mapping_at(cursor);
        if (m == NULL || m->addr != cursor || m->addr + m->size > end)
            return 0;
        cursor += m->size;
    }
    return size > 0;
}

int fake_range_has_access(uintptr_t addr, size_t size, int need_write)
{
    fake_lock();
    uintptr_t cursor = addr, end = addr + size;
    int ok = size > 0;
    while (ok && cursor < end) {
        struct mapping *m = mapping_at(cursor);
        ok = m != NULL && (m->access & ACCESS_READ) && (!need_write || m->access == ACCESS_READWRITE);
        if (ok)
            cursor = m->addr + m->size;
    }
    fake_unlock();
    return ok;
}

static int prop_ok(const CUmemAllocationProp *prop)
{
    return prop && prop->type == MEM_ALLOCATION_TYPE_PINNED && prop->location.type == MEM_LOCATION_TYPE_DEVICE
        && prop->location.id >= 0 && prop->location.id < FAKE_NUM_DEVICES;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option)
{
    CUresult r = !fake_initialized() ? CUDA_ERROR_NOT_INITIALIZED
               : (!prop_ok(prop) || option < 0 || option > 1) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        *granularity = FAKE_GRANULARITY;
    fake_log("cuMemGetAllocationGranularity", r, "option=%d", option);
    return r;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && (size == 0 || !aligned(size) || !aligned(alignment) || flags))
        r = CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment ? alignment : FAKE_GRANULARITY;
    void *raw = MAP_FAILED;
    if (r == CUDA_SUCCESS) {
        raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        r = raw == MAP_FAILED ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    }
    fake_lock();
    if (r == CUDA_SUCCESS && !grow((void **)&resvs, &cap_resvs, num_resvs, sizeof *resvs))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS) {
        uintptr_t start = ((uintptr_t)raw + align - 1) / align * align;
        if (start > (uintptr_t)raw)
            munmap(raw, start - (uintptr_t)raw);
        size_t tail = (uintptr_t)raw + size + align - (start + size);
        if (tail)
            munmap((void *)(start + size), tail);
        resvs[num_resvs++] = (struct reservation){start, size};
        *ptr = start;
    } else if (raw != MAP_FAILED) {
        munmap(raw, size + align);
    }
    fake_unlock();
    fake_log("cuMemAddressReserve", r, "size=%zu hint=%#llx ptr=%#llx", size, addr,
             r == CUDA_SUCCESS ? *ptr : 0ULL);
    return r;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    CUresult r = fake_need_context();
    fake_lock();
    size_t i = 0;
    while (r == CUDA_SUCCESS && i < num_resvs && resvs[i].base != ptr)
        i++;
    if (r == CUDA_SUCCESS && (i == num_resvs || resvs[i].size != size))
        r = CUDA_ERROR_INVALID_VALUE;
    for (size_t m = 0; r == CUDA_SUCCESS && m < num_maps; m++)
        if (maps[m].addr >= ptr && maps[m].addr < ptr + size)
            r = CUDA_ERROR_INVALID_VALUE; /* still mapped inside */
    if (r == CUDA_SUCCESS) {
        munmap((void *)(uintptr_t)ptr, size);
        resvs[i] = resvs[--num_resvs];
    }
    fake_unlock();
    fake_log("cuMemAddressFree", r, "ptr=%#llx size=%zu", ptr, size);
    return r;
}

static CUresult add_allocation(int fd, size_t size, int exportable, int created,
                               CUmemGenericAllocationHandle *handle)
{
    if (!grow((void **)&allocs, &cap_allocs, num_allocs, sizeof *allocs))
        return CUDA_ERROR_OUT_OF_MEMORY;
    allocs[num_allocs++] = (struct allocation){fd, size, 0, 0, exportable, created};
    *handle = num_allocs;
    if (created)
        created_bytes += size;
    return CUDA_SUCCESS;
}

/* Fill a new allocation with bytes a previous owner might have left (never zeros). */
static int fill_garbage(int fd, size_t size, unsigned seed)
{
    void *bytes = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (bytes == MAP_FAILED)
        return 0;
    memset(bytes, 0xC0 | (seed & 0x3F), size);
    munmap(bytes, size);
    return 1;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && (!prop_ok(prop) || size == 0 || !aligned(size) || flags))
        r = CUDA_ERROR_INVALID_VALUE;
    fake_lock();
    if (r == CUDA_SUCCESS && created_bytes + size > fake_total_bytes())
        r = CUDA_ERROR_OUT_OF_MEMORY;
    int fd = -1;
    if (r == CUDA_SUCCESS) {
        fd = memfd_create(FAKE_MEMFD_NAME, MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)size) != 0 || !fill_garbage(fd, size, (unsigned)num_allocs))
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS)
        r = add_allocation(fd, size, (prop->requestedHandleTypes & MEM_HANDLE_TYPE_POSIX_FD) != 0, 1, handle);
    if (r != CUDA_SUCCESS && fd >= 0)
        close(fd);
    fake_unlock();
    fake_log("cuMemCreate", r, "size=%zu handle=%llu", size, r == CUDA_SUCCESS ? *handle : 0ULL);
    return r;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CUresult r = fake_need_context();
    fake_lock();
    struct allocation *a = find_alloc(handle);
    if (r == CUDA_SUCCESS && (a == NULL || a->released))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        a->released = 1;
        destroy_if_unused(a);
    }
    fake_unlock();
    fake_log("cuMemRelease", r, "handle=%llu", handle);
    return r;
}

CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle, int type,
                                      unsigned long long flags)
{
    CUresult r = fake_need_context();
    fake_lock();
    struct allocation *a = find_alloc(handle);
    if (r == CUDA_SUCCESS && (a == NULL || a->released || shareable == NULL || flags))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS && (type != MEM_HANDLE_TYPE_POSIX_FD || !a->exportable))
        r = CUDA_ERROR_NOT_SUPPORTED;
    int fd = -1;
    if (r == CUDA_SUCCESS) {
        fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
        r = fd < 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    }
    if (r == CUDA_SUCCESS)
        *(int *)shareable = fd;
    fake_unlock();
    fake_log("cuMemExportToShareableHandle", r, "handle=%llu fd=%d", handle, fd);
    return r;
}

/* 1 when fd is a memfd this double made (in any process). */
static int is_fake_memfd(int fd)
{
    char link[64], target[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0)
        return 0;
    target[n] = '\0';
    return strncmp(target, "/memfd:" FAKE_MEMFD_NAME, strlen("/memfd:" FAKE_MEMFD_NAME)) == 0;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type)
{
    CUresult r = fake_need_context();
    int fd = (int)(intptr_t)os_handle, own = -1;
    struct stat st;
    if (r == CUDA_SUCCESS && type != MEM_HANDLE_TYPE_POSIX_FD)
        r = CUDA_ERROR_NOT_SUPPORTED;
    if (r == CUDA_SUCCESS && (fstat(fd, &st) != 0 || !is_fake_memfd(fd) || !aligned((uintptr_t)st.st_size)))
        r = CUDA_ERROR_INVALID_VALUE;
    fake_lock();
    if (r == CUDA_SUCCESS) {
        own = fcntl(fd, F_DUPFD_CLOEXEC, 0); /* the caller keeps (and closes) its fd */
        r = own < 0 ? CUDA_ERROR_OUT_OF_MEMORY : add_allocation(own, (size_t)st.st_size, 1, 0, handle);
    }
    if (r != CUDA_SUCCESS && own >= 0)
        close(own);
    fake_unlock();
    fake_log("cuMemImportFromShareableHandle", r, "fd=%d handle=%llu", fd,
             r == CUDA_SUCCESS ? *handle : 0ULL);
    return r;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags)
{
    CUresult r = fake_need_context();
    fake_lock();
    struct allocation *a = find_alloc(handle);
    if (r == CUDA_SUCCESS && (a == NULL || a->released))
        r = CUDA_ERROR_INVALID_HANDLE;
    if (r == CUDA_SUCCESS && (!aligned(ptr) || !aligned(size) || !aligned(offset) || size == 0 || flags
                              || offset + size > a->size || reservation_of(ptr, size) == NULL))
        r = CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; r == CUDA_SUCCESS && i < num_maps; i++)
        if (maps[i].addr < ptr + size && ptr < maps[i].addr + maps[i].size)
            r = CUDA_ERROR_INVALID_VALUE; /* overlaps a mapping */
    if (r == CUDA_SUCCESS && !grow((void **)&maps, &cap_maps, num_maps, sizeof *maps))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS) {
        void *at = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, (off_t)offset);
        r = at == MAP_FAILED ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    }
    if (r == CUDA_SUCCESS) {
        maps[num_maps++] = (struct mapping){ptr, size, handle, ACCESS_NONE};
        a->num_maps++;
    }
    fake_unlock();
    fake_log("cuMemMap", r, "ptr=%#llx size=%zu handle=%llu", ptr, size, handle);
    return r;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    CUresult r = fake_need_context();
    int flags = desc && count ? desc[0].flags : -1;
    if (r == CUDA_SUCCESS && (count != 1 || desc[0].location.type != MEM_LOCATION_TYPE_DEVICE
                              || desc[0].location.id < 0 || desc[0].location.id >= FAKE_NUM_DEVICES
                              || (flags != ACCESS_NONE && flags != ACCESS_READ && flags != ACCESS_READWRITE)))
        r = CUDA_ERROR_INVALID_VALUE;
    fake_lock();
    if (r == CUDA_SUCCESS && !whole_mappings(ptr, size))
        r = CUDA_ERROR_INVALID_VALUE;
    int prot = flags == ACCESS_READWRITE ? PROT_READ | PROT_WRITE : flags == ACCESS_READ ? PROT_READ : PROT_NONE;
    for (uintptr_t cursor = ptr; r == CUDA_SUCCESS && cursor < ptr + size;) {
        struct mapping *m = mapping_at(cursor);
        if (mprotect((void *)m->addr, m->size, prot) != 0)
            r = CUDA_ERROR_INVALID_VALUE;
        m->access = flags;
        cursor += m->size;
    }
    fake_unlock();
    fake_log("cuMemSetAccess", r, "ptr=%#llx size=%zu flags=%d", ptr, size, flags);
    return r;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult r = fake_need_context();
    fake_lock();
    if (r == CUDA_SUCCESS && !whole_mappings(ptr, size))
        r = CUDA_ERROR_INVALID_VALUE;
    for (uintptr_t cursor = ptr; r == CUDA_SUCCESS && cursor < ptr + size;) {
        struct mapping *m = mapping_at(cursor);
        size_t span = m->size;
        mmap((void *)m->addr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        struct allocation *a = &allocs[m->handle - 1];
        a->num_maps--;
        destroy_if_unused(a);
        *m = maps[--num_maps];
        cursor += span;
    }
    fake_unlock();
    fake_log("cuMemUnmap", r, "ptr=%#llx size=%zu", ptr, size);
    return r;
}

CUresult cuMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS) {
        fake_lock();
        *total_bytes = fake_total_bytes();
        *free_bytes = *total_bytes - created_bytes;
        fake_unlock();
    }
    fake_log("cuMemGetInfo", r, "-");
    return r;
}

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr)
{
    CUresult r = !fake_initialized() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_SUCCESS;
    fake_lock();
    struct mapping *m = r == CUDA_SUCCESS ? mapping_at(ptr) : NULL;
    int host = r == CUDA_SUCCESS && m == NULL && fake_is_registered(ptr, 1);
    if (r == CUDA_SUCCESS && m == NULL && !host)
        r = CUDA_ERROR_INVALID_VALUE; /* not device memory: unmapped, or plain host memory */
    if (r == CUDA_SUCCESS) {
        switch (attribute) {
        case PTR_ATTR_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
        case PTR_ATTR_MEMORY_TYPE: *(unsigned int *)data = host ? MEMORYTYPE_HOST : MEMORYTYPE_DEVICE; break;
        case PTR_ATTR_DEVICE_ORDINAL: *(int *)data = 0; break;
        case PTR_ATTR_MAPPED: *(int *)data = 1; break;
        case PTR_ATTR_CONTEXT: *(CUcontext *)data = fake_current_context(); break;
        case PTR_ATTR_RANGE_START: if (m) { *(CUdeviceptr *)data = m->addr; break; } /* fall through */
        case PTR_ATTR_RANGE_SIZE: if (m) { *(size_t *)data = m->size; break; } /* fall through */
        default: r = CUDA_ERROR_INVALID_VALUE;
        }
    }
    fake_unlock();
    fake_log("cuPointerGetAttribute", r, "ptr=%#llx attribute=%d", ptr, attribute);
    return r;
}
