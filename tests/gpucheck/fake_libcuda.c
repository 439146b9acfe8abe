/* A stand-in for libcuda.so.1: the calls weft's CUDA client makes, answering as the driver does.
 *
 * Like the real driver it looks for an MPS control daemon at $CUDA_MPS_PIPE_DIRECTORY, or at
 * /tmp/nvidia-mps when that is unset. Found (the fake daemon's "control" FIFO is there), the
 * client is an MPS client held to the limits the daemon was given: the fake MPS control client
 * writes them to <pipe>/fake-limits as "<memory MiB> <active thread percent>". The client's own
 * CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=<n>M") can lower the memory limit, never raise it. Not
 * found, the client has a context of its own, limited only by the device.
 *
 * As the real driver does (seen on an H200, driver 580): an MPS client's SM count attribute shows
 * its share of the SMs, rounded down to whole TPCs of two SMs (25% of 132 is 32), its blocks run on
 * those alone, and cuMemGetInfo shows the device's memory, not the limit (which only refuses).
 *
 * An MPS client keeps the daemon it found (<pipe>/fake-daemon.pid, standing in for its server): once
 * that process is gone, its allocations and launches fail with CUDA_ERROR_MPS_CONNECTION_FAILED, as a
 * real client's do when its server dies. Where that daemon holds a lock on <pipe>/fake-daemon-<pid>.lock,
 * the lock is what says it lives, so a client in a PID namespace of its own (a pod's) tells too.
 *
 * When FAKE_GPU_WORLD names a directory, each process writes "<bytes held> <1 if MPS client>" to
 * <world>/<pid>, which the fake NVML reads as its process list. With FAKE_GPU_WORLD_LIVE=1 it also keeps
 * "<bytes held>" in <world>/live-<hostname>-<pid>, locked for its life: a pod's processes, whose PIDs
 * are their PID namespace's and may be the same in two pods, are told apart and known alive by it.
 *
 * With FAKE_CUDA_KERNEL_TIME=1 a kernel takes as long as it asks (its cycles at the 1000 kHz clock shown) and,
 * with FAKE_GPU_WORLD, appends "<start ns> <end ns>" (CLOCK_REALTIME) to <world>/<pid>.kernels, from which a
 * fake NVML can tell how busy the device was; without it a kernel returns at once.
 *
 * Faults: FAKE_CUDA_FAIL="cuInit=100,cuMemAlloc_v2=2" makes those calls answer those codes;
 * FAKE_CUDA_MPS_ONLY=1 refuses a context outside MPS (a GPU in EXCLUSIVE_PROCESS mode under MPS);
 * FAKE_CUDA_HANG="cuLaunchKernel" makes that call never return. FAKE_CUDA_TOTAL_MIB (81920)
 * and FAKE_CUDA_SMS (132) describe the device.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;

enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
       DEVICES_UNAVAILABLE = 46, INVALID_DEVICE = 101, INVALID_PTX = 218, NOT_FOUND = 500,
       MPS_CONNECTION_FAILED = 805 };

static int initialised, mps, sms = 132, pct = 100, server_pid, live_fd = -1;
static char server_lock[4200];
static long long total_bytes = 81920LL << 20, limit_bytes, used_bytes;

#define MAX_ALLOCS 256
static struct { CUdeviceptr ptr; size_t size; void *host; } allocs[MAX_ALLOCS];
static CUdeviceptr next_fake = 0x700000000000ULL;

static int listed(const char *list, const char *fn, int *code) {
    if (!list) return 0;
    size_t n = strlen(fn);
    for (const char *p = list; (p = strstr(p, fn)) != NULL; p += n) {
        if ((p == list || p[-1] == ',') && (p[n] == '=' || p[n] == ',' || p[n] == '\0')) {
            if (code) *code = p[n] == '=' ? atoi(p + n + 1) : 999;
            return 1;
        }
    }
    return 0;
}

#define ENTER(fn) do { \
    int code_; \
    if (listed(getenv("FAKE_CUDA_HANG"), fn, NULL)) for (;;) pause(); \
    if (listed(getenv("FAKE_CUDA_FAIL"), fn, &code_)) return code_; \
} while (0)

/* The daemon this client found is still there (a zombie is gone: nothing answers for it). */
/* The SMs a client may use: its active thread percentage of them, in whole TPCs (two SMs). */
static int allowed_sms(void) {
    if (pct >= 100) return sms;
    int n = sms * pct / 100 / 2 * 2;
    return n < 1 ? 1 : n;
}

static int server_alive(void) {
    if (server_lock[0]) {
        int fd = open(server_lock, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            int held = flock(fd, LOCK_SH | LOCK_NB) != 0;  /* the daemon's lock, or nobody's: it is gone */
            close(fd);
            return held;
        }
    }
    if (!server_pid) return 1;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", server_pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *end = strrchr(buf, ')');
    return end && end[1] == ' ' && end[2] != 'Z' && end[2] != 'X';
}

static void record(void) {
    const char *world = getenv("FAKE_GPU_WORLD");
    if (!world) return;
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/%d", world, (int)getpid());
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "%lld %d\n", used_bytes, mps);
    fclose(f);
    rename(tmp, path);
    const char *live = getenv("FAKE_GPU_WORLD_LIVE");
    if (!live || *live != '1') return;
    if (live_fd < 0) {
        char host[256] = "";
        gethostname(host, sizeof host - 1);
        snprintf(path, sizeof path, "%s/live-%s-%d", world, host, (int)getpid());
        live_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (live_fd < 0) return;
        if (flock(live_fd, LOCK_EX) != 0) {}
    }
    char buf[64];
    int n = snprintf(buf, sizeof buf, "%lld\n", used_bytes);
    if (ftruncate(live_fd, 0) != 0 || pwrite(live_fd, buf, (size_t)n, 0) < 0) {}
}

CUresult cuInit(unsigned flags) {
    ENTER("cuInit");
    if (flags != 0) return INVALID_VALUE;
    const char *v;
    if ((v = getenv("FAKE_CUDA_TOTAL_MIB"))) total_bytes = atoll(v) << 20;
    if ((v = getenv("FAKE_CUDA_SMS"))) sms = atoi(v);
    initialised = 1;
    return OK;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    ENTER("cuDeviceGet");
    if (!initialised) return NOT_INITIALIZED;
    if (ordinal != 0) return INVALID_DEVICE;
    *dev = 0;
    return OK;
}

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice dev) {
    ENTER("cuDeviceGetAttribute");
    if (dev != 0) return INVALID_DEVICE;
    *value = attribute == 16 ? allowed_sms() : attribute == 13 ? 1000 : 0;
    return OK;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER("cuDeviceGetName");
    if (dev != 0) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "Fake GPU");
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRetain");
    if (!initialised) return NOT_INITIALIZED;
    if (dev != 0) return INVALID_DEVICE;
    const char *pipe = getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (!pipe || !*pipe) pipe = "/tmp/nvidia-mps";
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/control", pipe);
    mps = stat(path, &st) == 0;
    const char *only = getenv("FAKE_CUDA_MPS_ONLY");
    if (!mps && only && *only == '1') return DEVICES_UNAVAILABLE;
    limit_bytes = total_bytes;
    if (mps) {
        snprintf(path, sizeof path, "%s/fake-limits", pipe);
        FILE *f = fopen(path, "r");
        long long mib;
        int p;
        if (f && fscanf(f, "%lld %d", &mib, &p) == 2) {
            if (mib > 0) limit_bytes = mib << 20;
            if (p > 0) pct = p;
        }
        if (f) fclose(f);
        snprintf(path, sizeof path, "%s/fake-daemon.pid", pipe);
        if ((f = fopen(path, "r"))) {
            if (fscanf(f, "%d", &server_pid) != 1) server_pid = 0;
            fclose(f);
        }
        snprintf(server_lock, sizeof server_lock, "%s/fake-daemon-%d.lock", pipe, server_pid);
        if (!server_pid || stat(server_lock, &st) != 0) server_lock[0] = '\0';
        const char *own = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
        if (own && strncmp(own, "0=", 2) == 0 && atoll(own + 2) > 0 && (atoll(own + 2) << 20) < limit_bytes)
            limit_bytes = atoll(own + 2) << 20;
        const char *threads = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
        if (threads && atoi(threads) > 0 && atoi(threads) < pct) pct = atoi(threads);
    }
    *ctx = (void *)0x1;
    record();
    return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return dev == 0 ? OK : INVALID_DEVICE; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx ? OK : INVALID_VALUE; }
CUresult cuCtxSynchronize(void) { ENTER("cuCtxSynchronize"); return OK; }

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    ENTER("cuMemGetInfo_v2");
    *total = (size_t)total_bytes;
    *free_bytes = (size_t)(total_bytes - used_bytes);
    return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size) {
    ENTER("cuMemAlloc_v2");
    if (!initialised) return NOT_INITIALIZED;
    if (!server_alive()) return MPS_CONNECTION_FAILED;
    if (size == 0) return INVALID_VALUE;
    if (used_bytes + (long long)size > limit_bytes) return OUT_OF_MEMORY;
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].size) continue;
        /* Small buffers (the kernel's output) are real host memory; large ones are only counted. */
        allocs[i].host = size <= (1u << 20) ? calloc(1, size) : NULL;
        allocs[i].ptr = allocs[i].host ? (CUdeviceptr)(uintptr_t)allocs[i].host : (next_fake += size + 4096);
        allocs[i].size = size;
        used_bytes += (long long)size;
        *ptr = allocs[i].ptr;
        record();
        return OK;
    }
    return OUT_OF_MEMORY;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].size && allocs[i].ptr == ptr) {
            used_bytes -= (long long)allocs[i].size;
            free(allocs[i].host);
            allocs[i].size = 0;
            record();
            return OK;
        }
    }
    return INVALID_VALUE;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t size) {
    ENTER("cuMemcpyDtoH_v2");
    memcpy(dst, (void *)(uintptr_t)src, size);
    return OK;
}

CUresult cuModuleLoadData(void **module, const void *image) {
    ENTER("cuModuleLoadData");
    if (!strstr((const char *)image, ".entry spin(")) return INVALID_PTX;
    *module = (void *)0x2;
    return OK;
}

CUresult cuModuleGetFunction(void **fn, void *module, const char *name) {
    ENTER("cuModuleGetFunction");
    if (!module || strcmp(name, "spin") != 0) return NOT_FOUND;
    *fn = (void *)0x3;
    return OK;
}

CUresult cuModuleUnload(void *module) { return module ? OK : INVALID_VALUE; }

/* Blocks land on the SMs an MPS client may use: its active thread percentage of them. */
CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
    (void)gy; (void)gz; (void)by; (void)bz; (void)shared; (void)stream; (void)extra;
    ENTER("cuLaunchKernel");
    if (!fn || !params || bx == 0) return INVALID_VALUE;
    if (!server_alive()) return MPS_CONNECTION_FAILED;
    uint32_t *out = (uint32_t *)(uintptr_t)*(CUdeviceptr *)params[0];
    int allowed = allowed_sms();
    for (unsigned i = 0; i < gx; i++) out[i] = i % (unsigned)allowed;
    const char *timed = getenv("FAKE_CUDA_KERNEL_TIME");
    if (timed && *timed == '1') {
        uint64_t cycles = *(uint64_t *)params[1];  /* at the 1000 kHz clock shown: one cycle a microsecond */
        struct timespec start, end, wait = { (time_t)(cycles / 1000000), (long)(cycles % 1000000) * 1000 };
        clock_gettime(CLOCK_REALTIME, &start);
        while (nanosleep(&wait, &wait) != 0) {}
        clock_gettime(CLOCK_REALTIME, &end);
        const char *world = getenv("FAKE_GPU_WORLD");
        if (world) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%d.kernels", world, (int)getpid());
            FILE *f = fopen(path, "a");
            if (f) {
                fprintf(f, "%lld %lld\n", (long long)start.tv_sec * 1000000000LL + start.tv_nsec,
                        (long long)end.tv_sec * 1000000000LL + end.tv_nsec);
                fclose(f);
            }
        }
    }
    return OK;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
    switch (error) {
    case OK: *name = "CUDA_SUCCESS"; return OK;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return OK;
    case NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; return OK;
    case NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; return OK;
    case DEVICES_UNAVAILABLE: *name = "CUDA_ERROR_DEVICES_UNAVAILABLE"; return OK;
    case INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; return OK;
    case INVALID_PTX: *name = "CUDA_ERROR_INVALID_PTX"; return OK;
    case NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; return OK;
    case MPS_CONNECTION_FAILED: *name = "CUDA_ERROR_MPS_CONNECTION_FAILED"; return OK;
    default: return INVALID_VALUE;
    }
}
