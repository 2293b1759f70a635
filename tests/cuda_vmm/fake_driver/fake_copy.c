/* Copies, memsets, host registration and synchronisation.
 *
 * Rules kept: each call needs a live current context; device ranges must be
 * mapped with the access the call needs (read for DtoH, read-write for HtoD
 * and memsets), else CUDA_ERROR_ILLEGAL_ADDRESS and nothing is copied; a host
 * range is registered once and unregistered by its base. Copies log whether
 * their host side was registered ("pinned=1"), so a test can check that the
 * daemon's swap copies use page-locked buffers. Work is synchronous, so
 * cuCtxSynchronize and cuStreamSynchronize have nothing to wait for; a stream
 * is a live handle until destroyed (NULL is the default stream), and an async
 * copy on a dead stream is CUDA_ERROR_INVALID_HANDLE.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"

struct registration { uintptr_t base; size_t size; };
static struct registration *regs;
static size_t num_regs, cap_regs;

/* 1 when [addr, addr + size) lies in one registered host range. Call with the lock held. */
int fake_is_registered(uintptr_t addr, size_t size)
{
    for (size_t i = 0; i < num_regs; i++)
        if (addr >= regs[i].base && addr + size <= regs[i].base + regs[i].size)
            return 1;
    return 0;
}

static int registered(const void *host, size_t size)
{
    fake_lock();
    int yes = fake_is_registered((uintptr_t)host, size);
    fake_unlock();
    return yes;
}

CUresult cuCtxSynchronize(void)
{
    CUresult r = fake_need_context();
    fake_log("cuCtxSynchronize", r, "-");
    return r;
}

CUresult cuMemHostRegister(void *host, size_t size, unsigned int flags)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && (host == NULL || size == 0))
        r = CUDA_ERROR_INVALID_VALUE;
    fake_lock();
    for (size_t i = 0; r == CUDA_SUCCESS && i < num_regs; i++)
        if ((uintptr_t)host < regs[i].base + regs[i].size && regs[i].base < (uintptr_t)host + size)
            r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if (r == CUDA_SUCCESS && num_regs == cap_regs) {
        size_t next = cap_regs ? 2 * cap_regs : 16;
        struct registration *bigger = realloc(regs, next * sizeof *regs);
        if (bigger == NULL)
            r = CUDA_ERROR_OUT_OF_MEMORY;
        else
            regs = bigger, cap_regs = next;
    }
    if (r == CUDA_SUCCESS)
        regs[num_regs++] = (struct registration){(uintptr_t)host, size};
    fake_unlock();
    fake_log("cuMemHostRegister", r, "ptr=%p size=%zu flags=%u", host, size, flags);
    return r;
}

CUresult cuMemHostUnregister(void *host)
{
    CUresult r = fake_need_context();
    fake_lock();
    size_t i = 0;
    while (i < num_regs && regs[i].base != (uintptr_t)host)
        i++;
    if (r == CUDA_SUCCESS && i == num_regs)
        r = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    if (r == CUDA_SUCCESS)
        regs[i] = regs[--num_regs];
    fake_unlock();
    fake_log("cuMemHostUnregister", r, "ptr=%p", host);
    return r;
}

CUresult cuMemcpyDtoH(void *host, CUdeviceptr device, size_t size)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && !fake_range_has_access(device, size, 0))
        r = CUDA_ERROR_ILLEGAL_ADDRESS;
    if (r == CUDA_SUCCESS)
        memcpy(host, (const void *)(uintptr_t)device, size);
    fake_log("cuMemcpyDtoH", r, "src=%#llx size=%zu pinned=%d", device, size, registered(host, size));
    return r;
}

CUresult cuMemcpyHtoD(CUdeviceptr device, const void *host, size_t size)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && !fake_range_has_access(device, size, 1))
        r = CUDA_ERROR_ILLEGAL_ADDRESS;
    if (r == CUDA_SUCCESS)
        memcpy((void *)(uintptr_t)device, host, size);
    fake_log("cuMemcpyHtoD", r, "dst=%#llx size=%zu pinned=%d", device, size, registered(host, size));
    return r;
}

CUresult cuMemsetD8(CUdeviceptr device, unsigned char value, size_t count)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && !fake_range_has_access(device, count, 1))
        r = CUDA_ERROR_ILLEGAL_ADDRESS;
    if (r == CUDA_SUCCESS)
        memset((void *)(uintptr_t)device, value, count);
    fake_log("cuMemsetD8", r, "dst=%#llx size=%zu value=%u", device, count, value);
    return r;
}

CUresult cuMemsetD32(CUdeviceptr device, unsigned int value, size_t count)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && (device % 4 || !fake_range_has_access(device, 4 * count, 1)))
        r = CUDA_ERROR_ILLEGAL_ADDRESS;
    unsigned int *words = (unsigned int *)(uintptr_t)device;
    for (size_t i = 0; r == CUDA_SUCCESS && i < count; i++)
        words[i] = value;
    fake_log("cuMemsetD32", r, "dst=%#llx words=%zu value=%u", device, count, value);
    return r;
}

struct fake_stream { unsigned magic; };
#define FAKE_STREAM_MAGIC 0x5354524du

static int live_stream(CUstream stream)
{
    return stream == NULL || stream->magic == FAKE_STREAM_MAGIC;
}

CUresult cuStreamCreate(CUstream *stream, unsigned int flags)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && stream == NULL)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        struct fake_stream *made = malloc(sizeof *made);
        if (made == NULL)
            r = CUDA_ERROR_OUT_OF_MEMORY;
        else
            made->magic = FAKE_STREAM_MAGIC, *stream = made;
    }
    fake_log("cuStreamCreate", r, "flags=%u", flags);
    return r;
}

CUresult cuStreamDestroy(CUstream stream)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && (stream == NULL || !live_stream(stream)))
        r = CUDA_ERROR_INVALID_HANDLE;
    if (r == CUDA_SUCCESS)
        stream->magic = 0; /* kept, so a later use reads as dead rather than freed memory */
    fake_log("cuStreamDestroy", r, "stream=%p", (void *)stream);
    return r;
}

CUresult cuStreamSynchronize(CUstream stream)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && !live_stream(stream))
        r = CUDA_ERROR_INVALID_HANDLE;
    fake_log("cuStreamSynchronize", r, "stream=%p", (void *)stream);
    return r;
}

CUresult cuMemcpyDtoHAsync(void *host, CUdeviceptr device, size_t size, CUstream stream)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && !live_stream(stream))
        r = CUDA_ERROR_INVALID_HANDLE;
    if (r == CUDA_SUCCESS && !fake_range_has_access(device, size, 0))
        r = CUDA_ERROR_ILLEGAL_ADDRESS;
    if (r == CUDA_SUCCESS)
        memcpy(host, (const void *)(uintptr_t)device, size);
    fake_log("cuMemcpyDtoHAsync", r, "src=%#llx size=%zu pinned=%d", device, size, registered(host, size));
    return r;
}

CUresult cuMemcpyHtoDAsync(CUdeviceptr device, const void *host, size_t size, CUstream stream)
{
    CUresult r = fake_need_context();
    if (r == CUDA_SUCCESS && !live_stream(stream))
        r = CUDA_ERROR_INVALID_HANDLE;
    if (r == CUDA_SUCCESS && !fake_range_has_access(device, size, 1))
        r = CUDA_ERROR_ILLEGAL_ADDRESS;
    if (r == CUDA_SUCCESS)
        memcpy((void *)(uintptr_t)device, host, size);
    fake_log("cuMemcpyHtoDAsync", r, "dst=%#llx size=%zu pinned=%d", device, size, registered(host, size));
    return r;
}
