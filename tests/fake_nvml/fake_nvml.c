/*
 * FAKE libnvidia-ml.so.1 for forewarn's tests and benchmarks. It is NOT NVIDIA's library.
 *
 * It implements only the NVML entry points that forewarn.agent.sources.nvml calls, with
 * the same C signatures and struct layouts as nvml.h, so that the real nvidia-ml-py
 * (pynvml) code paths run against it. Values come from a text file named by the
 * environment variable FAKE_NVML_CONFIG, read at nvmlInit and re-read whenever the file
 * changes (inode, size or mtime), so a test can script a node while the backend polls.
 *
 * Config format, one setting per line, '#' starts a comment:
 *
 *   count 8                     number of GPUs (default 1, at most 64)
 *   init_error 9                nvmlInit returns this NVML error code (9 = DRIVER_NOT_LOADED)
 *   xid 0 79                    emit XID 79 on GPU 0 through the event set, once per line
 *   <sel>.<key> <value>         per GPU setting; <sel> is a GPU index or '*' (all GPUs)
 *
 * Keys: name uuid busid serial (strings); temp memtemp slowdown margin power_mw
 * power_limit_mw sm_clock mem_clock util_gpu util_mem mem_total mem_used throttle pstate
 * ecc_sbe_vol ecc_dbe_vol ecc_sbe_agg ecc_dbe_agg retired_sbe retired_dbe retired_pending
 * remap_cor remap_unc remap_pending remap_failure pcie_replay link_gen link_gen_max
 * link_width link_width_max nvlinks energy_mj lost reset_required (integers);
 * nvlink_crc_flit nvlink_crc_data nvlink_replay nvlink_recovery (integers; all links, or
 * one link with a ".<link>" suffix: "0.nvlink_replay.3 5");
 * unsupported, fail: comma-separated keys (or groups: ecc retired remap nvlink events
 * margin) answered with NVML_ERROR_NOT_SUPPORTED or NVML_ERROR_UNKNOWN.
 *
 * A GPU with lost=1 answers every device call with NVML_ERROR_GPU_IS_LOST; with
 * reset_required=1, NVML_ERROR_RESET_REQUIRED.
 *
 * Extra, non-NVML symbol for tests: fake_nvml_calls(key) = how many times a getter for
 * <key> was asked (to check that unsupported fields are not re-queried each poll).
 */

#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_RESET_REQUIRED 16
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 64
#define MAX_LINKS 36
#define MAX_XIDS 4096
#define EVENT_XID 0x8ULL

enum {
    K_TEMP, K_MEMTEMP, K_SLOWDOWN, K_MARGIN, K_POWER, K_POWER_LIMIT, K_SM_CLOCK, K_MEM_CLOCK,
    K_UTIL_GPU, K_UTIL_MEM, K_MEM_TOTAL, K_MEM_USED, K_THROTTLE, K_PSTATE,
    K_ECC_SBE_VOL, K_ECC_DBE_VOL, K_ECC_SBE_AGG, K_ECC_DBE_AGG,
    K_RETIRED_SBE, K_RETIRED_DBE, K_RETIRED_PENDING,
    K_REMAP_COR, K_REMAP_UNC, K_REMAP_PENDING, K_REMAP_FAILURE,
    K_PCIE_REPLAY, K_LINK_GEN, K_LINK_GEN_MAX, K_LINK_WIDTH, K_LINK_WIDTH_MAX,
    K_NVLINKS, K_ENERGY, K_LOST, K_RESET, K_COUNT
};

static const char *KEYS[K_COUNT] = {
    "temp", "memtemp", "slowdown", "margin", "power_mw", "power_limit_mw", "sm_clock",
    "mem_clock", "util_gpu", "util_mem", "mem_total", "mem_used", "throttle", "pstate",
    "ecc_sbe_vol", "ecc_dbe_vol", "ecc_sbe_agg", "ecc_dbe_agg",
    "retired_sbe", "retired_dbe", "retired_pending",
    "remap_cor", "remap_unc", "remap_pending", "remap_failure",
    "pcie_replay", "link_gen", "link_gen_max", "link_width", "link_width_max",
    "nvlinks", "energy_mj", "lost", "reset_required",
};

static const long long DEFAULTS[K_COUNT] = {
    40, 45, 87, -1, 100000, 700000, 1980, 2619,
    50, 30, 85899345920LL, 1073741824LL, 0, 0,
    0, 0, 0, 0,
    0, 0, 0,
    0, 0, 0, 0,
    0, 5, 5, 16, 16,
    0, 123456789000LL, 0, 0,
};

/* NVLink counters, in the order of nvmlNvLinkErrorCounter_t. */
enum { NL_REPLAY, NL_RECOVERY, NL_CRC_FLIT, NL_CRC_DATA, NL_COUNT };
static const char *NL_KEYS[NL_COUNT] = {
    "nvlink_replay", "nvlink_recovery", "nvlink_crc_flit", "nvlink_crc_data",
};

typedef struct {
    int index; /* a device handle is a pointer to one of these */
    char name[96], uuid[96], busid[32], serial[32];
    long long v[K_COUNT];
    unsigned long long nl[NL_COUNT][MAX_LINKS];
    char unsupported[1024];
    char fail[1024];
} fake_gpu;

typedef struct {
    int count;
    int init_error;
    int nxid;
    int xid_gpu[MAX_XIDS];
    unsigned long long xid_code[MAX_XIDS];
    fake_gpu gpu[MAX_GPUS];
} fake_config;

typedef struct {
    unsigned long long mask[MAX_GPUS];
} fake_event_set;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned int version; int marginTemperature; } nvmlMarginTemperature_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    int nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    fake_gpu *device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static fake_config cfg;        /* guarded by lock */
static fake_gpu handles[MAX_GPUS]; /* stable addresses; contents copied from cfg */
static struct stat last_stat;
static int have_stat;
static int initialized;
static int xid_emitted;
static unsigned long long calls[K_COUNT + NL_COUNT + 8];

static void set_defaults(fake_config *c) {
    memset(c, 0, sizeof(*c));
    c->count = 1;
    for (int i = 0; i < MAX_GPUS; i++) {
        fake_gpu *g = &c->gpu[i];
        g->index = i;
        snprintf(g->name, sizeof g->name, "FAKE NVML GPU");
        snprintf(g->uuid, sizeof g->uuid, "GPU-fake0000-0000-0000-0000-%012d", i);
        snprintf(g->busid, sizeof g->busid, "00000000:%02X:00.0", 0x10 + i);
        snprintf(g->serial, sizeof g->serial, "FAKE%08d", i);
        memcpy(g->v, DEFAULTS, sizeof DEFAULTS);
    }
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    char *e = s + strlen(s);
    while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\n' || e[-1] == '\r')) *--e = 0;
    return s;
}

static void set_gpu_key(fake_gpu *g, const char *key, const char *val) {
    if (!strcmp(key, "name")) { snprintf(g->name, sizeof g->name, "%s", val); return; }
    if (!strcmp(key, "uuid")) { snprintf(g->uuid, sizeof g->uuid, "%s", val); return; }
    if (!strcmp(key, "busid")) { snprintf(g->busid, sizeof g->busid, "%s", val); return; }
    if (!strcmp(key, "serial")) { snprintf(g->serial, sizeof g->serial, "%s", val); return; }
    if (!strcmp(key, "unsupported")) {
        snprintf(g->unsupported, sizeof g->unsupported, ",%s,", val);
        return;
    }
    if (!strcmp(key, "fail")) { snprintf(g->fail, sizeof g->fail, ",%s,", val); return; }
    for (int k = 0; k < K_COUNT; k++) {
        if (!strcmp(key, KEYS[k])) { g->v[k] = strtoll(val, NULL, 0); return; }
    }
    for (int n = 0; n < NL_COUNT; n++) {
        size_t len = strlen(NL_KEYS[n]);
        if (strncmp(key, NL_KEYS[n], len)) continue;
        unsigned long long x = strtoull(val, NULL, 0);
        if (key[len] == 0) {
            for (int l = 0; l < MAX_LINKS; l++) g->nl[n][l] = x;
            return;
        }
        if (key[len] == '.') {
            int l = atoi(key + len + 1);
            if (l >= 0 && l < MAX_LINKS) g->nl[n][l] = x;
            return;
        }
    }
    fprintf(stderr, "fake_nvml: unknown key %s\n", key);
}

static void parse(fake_config *c, FILE *f) {
    char line[2048];
    while (fgets(line, sizeof line, f)) {
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *s = trim(line);
        if (!*s) continue;
        char *sp = strpbrk(s, " \t");
        if (!sp) continue;
        *sp = 0;
        char *key = s, *val = trim(sp + 1);
        if (!strcmp(key, "count")) {
            c->count = atoi(val);
            if (c->count < 0) c->count = 0;
            if (c->count > MAX_GPUS) c->count = MAX_GPUS;
        } else if (!strcmp(key, "init_error")) {
            c->init_error = atoi(val);
        } else if (!strcmp(key, "xid")) {
            int gpu = 0;
            unsigned long long code = 0;
            if (sscanf(val, "%d %llu", &gpu, &code) == 2 && c->nxid < MAX_XIDS) {
                c->xid_gpu[c->nxid] = gpu;
                c->xid_code[c->nxid] = code;
                c->nxid++;
            }
        } else {
            char *dot = strchr(key, '.');
            if (!dot) { fprintf(stderr, "fake_nvml: bad line key %s\n", key); continue; }
            *dot = 0;
            const char *sel = key, *gkey = dot + 1;
            if (!strcmp(sel, "*")) {
                for (int i = 0; i < MAX_GPUS; i++) set_gpu_key(&c->gpu[i], gkey, val);
            } else {
                int i = atoi(sel);
                if (i >= 0 && i < MAX_GPUS) set_gpu_key(&c->gpu[i], gkey, val);
            }
        }
    }
}

/* Re-read the config when the file changed. Caller holds the lock. */
static void reload(int force) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    struct stat st;
    if (!path || stat(path, &st) != 0) {
        if (force || have_stat) {
            set_defaults(&cfg);
            have_stat = 0;
        }
        return;
    }
    if (!force && have_stat && st.st_ino == last_stat.st_ino && st.st_size == last_stat.st_size
        && st.st_mtim.tv_sec == last_stat.st_mtim.tv_sec
        && st.st_mtim.tv_nsec == last_stat.st_mtim.tv_nsec)
        return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    static fake_config fresh;
    set_defaults(&fresh);
    parse(&fresh, f);
    fclose(f);
    memcpy(&cfg, &fresh, sizeof cfg);
    last_stat = st;
    have_stat = 1;
}

static int in_list(const char *list, const char *name) {
    if (!list[0]) return 0;
    char pat[80];
    snprintf(pat, sizeof pat, ",%s,", name);
    return strstr(list, pat) != NULL;
}

/* Common entry of every device getter: reload, validate the handle, count the call and
 * answer lost / reset required / not supported / fail. Returns with the lock held when
 * the result is NVML_SUCCESS and *out points at the GPU's current settings. */
static nvmlReturn_t enter(fake_gpu *dev, int counter, const char *key, const char *group,
                          fake_gpu **out) {
    pthread_mutex_lock(&lock);
    if (!initialized) { pthread_mutex_unlock(&lock); return NVML_ERROR_UNINITIALIZED; }
    reload(0);
    if (dev < handles || dev >= handles + MAX_GPUS || dev->index >= cfg.count) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    fake_gpu *g = &cfg.gpu[dev->index];
    if (counter >= 0) calls[counter]++;
    nvmlReturn_t ret = NVML_SUCCESS;
    if (g->v[K_LOST]) ret = NVML_ERROR_GPU_IS_LOST;
    else if (g->v[K_RESET]) ret = NVML_ERROR_RESET_REQUIRED;
    else if (key && (in_list(g->unsupported, key) || (group && in_list(g->unsupported, group))))
        ret = NVML_ERROR_NOT_SUPPORTED;
    else if (key && (in_list(g->fail, key) || (group && in_list(g->fail, group))))
        ret = NVML_ERROR_UNKNOWN;
    if (ret != NVML_SUCCESS) { pthread_mutex_unlock(&lock); return ret; }
    *out = g;
    return NVML_SUCCESS;
}

#define LEAVE(ret) do { pthread_mutex_unlock(&lock); return (ret); } while (0)

/* ---- library ---- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    reload(1);
    xid_emitted = 0;
    memset(calls, 0, sizeof calls);
    int err = cfg.init_error;
    if (!err) {
        initialized = 1;
        for (int i = 0; i < MAX_GPUS; i++) handles[i].index = i;
    }
    pthread_mutex_unlock(&lock);
    return err;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    initialized = 0;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires reset";
    case 9: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    snprintf(version, length, "fake-nvml-0.1");
    return NVML_SUCCESS;
}

unsigned long long fake_nvml_calls(const char *key) {
    pthread_mutex_lock(&lock);
    unsigned long long n = 0;
    for (int k = 0; k < K_COUNT; k++)
        if (!strcmp(key, KEYS[k])) n = calls[k];
    for (int k = 0; k < NL_COUNT; k++)
        if (!strcmp(key, NL_KEYS[k])) n = calls[K_COUNT + k];
    pthread_mutex_unlock(&lock);
    return n;
}

/* ---- inventory ---- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    pthread_mutex_lock(&lock);
    if (!initialized) LEAVE(NVML_ERROR_UNINITIALIZED);
    reload(0);
    *count = (unsigned int)cfg.count;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, fake_gpu **device) {
    pthread_mutex_lock(&lock);
    if (!initialized) LEAVE(NVML_ERROR_UNINITIALIZED);
    reload(0);
    if (index >= (unsigned int)cfg.count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (cfg.gpu[index].v[K_LOST]) LEAVE(NVML_ERROR_GPU_IS_LOST);
    *device = &handles[index];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetName(fake_gpu *dev, char *name, unsigned int length) {
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, -1, "name", NULL, &g);
    if (r) return r;
    snprintf(name, length, "%s", g->name);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUUID(fake_gpu *dev, char *uuid, unsigned int length) {
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, -1, "uuid", NULL, &g);
    if (r) return r;
    snprintf(uuid, length, "%s", g->uuid);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSerial(fake_gpu *dev, char *serial, unsigned int length) {
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, -1, "serial", NULL, &g);
    if (r) return r;
    snprintf(serial, length, "%s", g->serial);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(fake_gpu *dev, nvmlPciInfo_t *pci) {
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, -1, "busid", NULL, &g);
    if (r) return r;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", g->busid);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%.15s", g->busid);
    pci->bus = 0x10 + (unsigned int)g->index;
    pci->pciDeviceId = 0x233010DE;
    LEAVE(NVML_SUCCESS);
}

/* ---- per-poll getters ---- */

#define SIMPLE_GETTER(fn, key_id, type)                                       \
    nvmlReturn_t fn(fake_gpu *dev, type *out) {                               \
        fake_gpu *g;                                                          \
        nvmlReturn_t r = enter(dev, key_id, KEYS[key_id], NULL, &g);          \
        if (r) return r;                                                      \
        *out = (type)g->v[key_id];                                            \
        LEAVE(NVML_SUCCESS);                                                  \
    }

SIMPLE_GETTER(nvmlDeviceGetPowerUsage, K_POWER, unsigned int)
SIMPLE_GETTER(nvmlDeviceGetEnforcedPowerLimit, K_POWER_LIMIT, unsigned int)
SIMPLE_GETTER(nvmlDeviceGetCurrentClocksEventReasons, K_THROTTLE, unsigned long long)
SIMPLE_GETTER(nvmlDeviceGetPerformanceState, K_PSTATE, int)
SIMPLE_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, K_LINK_GEN, unsigned int)
SIMPLE_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, K_LINK_GEN_MAX, unsigned int)
SIMPLE_GETTER(nvmlDeviceGetCurrPcieLinkWidth, K_LINK_WIDTH, unsigned int)
SIMPLE_GETTER(nvmlDeviceGetMaxPcieLinkWidth, K_LINK_WIDTH_MAX, unsigned int)
/* millijoules since the driver loaded (Volta and later) */
SIMPLE_GETTER(nvmlDeviceGetTotalEnergyConsumption, K_ENERGY, unsigned long long)

nvmlReturn_t nvmlDeviceGetTemperature(fake_gpu *dev, int sensor, unsigned int *temp) {
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT; /* NVML_TEMPERATURE_GPU */
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, K_TEMP, "temp", NULL, &g);
    if (r) return r;
    *temp = (unsigned int)g->v[K_TEMP];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(fake_gpu *dev, int threshold, unsigned int *temp) {
    if (threshold != 1) return NVML_ERROR_NOT_SUPPORTED; /* only ..._THRESHOLD_SLOWDOWN */
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, K_SLOWDOWN, "slowdown", NULL, &g);
    if (r) return r;
    *temp = (unsigned int)g->v[K_SLOWDOWN];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMarginTemperature(fake_gpu *dev, nvmlMarginTemperature_t *m) {
    if (m->version != 0x1000008) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, K_MARGIN, "margin", NULL, &g);
    if (r) return r;
    /* margin -1 (default): distance from the slowdown threshold */
    long long margin = g->v[K_MARGIN];
    if (margin == -1) margin = g->v[K_SLOWDOWN] - g->v[K_TEMP];
    m->marginTemperature = (int)margin;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetClockInfo(fake_gpu *dev, int type, unsigned int *clock) {
    int k = type == 1 ? K_SM_CLOCK : type == 2 ? K_MEM_CLOCK : -1;
    if (k < 0) return NVML_ERROR_NOT_SUPPORTED;
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, k, KEYS[k], NULL, &g);
    if (r) return r;
    *clock = (unsigned int)g->v[k];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(fake_gpu *dev, nvmlUtilization_t *u) {
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, K_UTIL_GPU, "util_gpu", "util", &g);
    if (r) return r;
    u->gpu = (unsigned int)g->v[K_UTIL_GPU];
    u->memory = (unsigned int)g->v[K_UTIL_MEM];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(fake_gpu *dev, nvmlMemory_t *m) {
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, K_MEM_USED, "mem_used", "memory", &g);
    if (r) return r;
    m->total = (unsigned long long)g->v[K_MEM_TOTAL];
    m->used = (unsigned long long)g->v[K_MEM_USED];
    m->free = m->total > m->used ? m->total - m->used : 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(fake_gpu *dev, unsigned int link, int counter,
                                             unsigned long long *value) {
    if (counter < 0 || counter >= NL_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, K_COUNT + counter, NL_KEYS[counter], "nvlink", &g);
    if (r) return r;
    if (link >= (unsigned int)g->v[K_NVLINKS] || link >= MAX_LINKS)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *value = g->nl[counter][link];
    LEAVE(NVML_SUCCESS);
}

/* ---- field values (nvmlDeviceGetFieldValues) ---- */

#define VT_UINT 1
#define VT_ULL 3

/* Map an NVML_FI_DEV_* id to a fake key, or to an NVLink counter and link. */
static int field_key(unsigned int id, int *nl_counter, int *link) {
    *nl_counter = -1;
    *link = -1;
    switch (id) {
    case 3: return K_ECC_SBE_VOL;     /* NVML_FI_DEV_ECC_SBE_VOL_TOTAL */
    case 4: return K_ECC_DBE_VOL;     /* NVML_FI_DEV_ECC_DBE_VOL_TOTAL */
    case 5: return K_ECC_SBE_AGG;     /* NVML_FI_DEV_ECC_SBE_AGG_TOTAL */
    case 6: return K_ECC_DBE_AGG;     /* NVML_FI_DEV_ECC_DBE_AGG_TOTAL */
    case 29: return K_RETIRED_SBE;    /* NVML_FI_DEV_RETIRED_SBE */
    case 30: return K_RETIRED_DBE;    /* NVML_FI_DEV_RETIRED_DBE */
    case 31: return K_RETIRED_PENDING; /* NVML_FI_DEV_RETIRED_PENDING */
    case 82: return K_MEMTEMP;        /* NVML_FI_DEV_MEMORY_TEMP */
    case 91: return K_NVLINKS;        /* NVML_FI_DEV_NVLINK_LINK_COUNT */
    case 94: return K_PCIE_REPLAY;    /* NVML_FI_DEV_PCIE_REPLAY_COUNTER */
    case 142: return K_REMAP_COR;     /* NVML_FI_DEV_REMAPPED_COR */
    case 143: return K_REMAP_UNC;     /* NVML_FI_DEV_REMAPPED_UNC */
    case 144: return K_REMAP_PENDING; /* NVML_FI_DEV_REMAPPED_PENDING */
    case 145: return K_REMAP_FAILURE; /* NVML_FI_DEV_REMAPPED_FAILURE */
    }
    /* Per-link NVLink counters: L0..L5 at 32/39/46/53, L6..L11 at 96/102/108/114. */
    static const unsigned int lo[4] = {32, 39, 46, 53}, hi[4] = {96, 102, 108, 114};
    static const int which[4] = {NL_CRC_FLIT, NL_CRC_DATA, NL_REPLAY, NL_RECOVERY};
    for (int i = 0; i < 4; i++) {
        if (id >= lo[i] && id < lo[i] + 6) { *nl_counter = which[i]; *link = (int)(id - lo[i]); }
        if (id >= hi[i] && id < hi[i] + 6) { *nl_counter = which[i]; *link = (int)(id - hi[i]) + 6; }
    }
    return -1;
}

static const char *group_of(int k) {
    if (k >= K_ECC_SBE_VOL && k <= K_ECC_DBE_AGG) return "ecc";
    if (k >= K_RETIRED_SBE && k <= K_RETIRED_PENDING) return "retired";
    if (k >= K_REMAP_COR && k <= K_REMAP_FAILURE) return "remap";
    if (k == K_NVLINKS) return "nvlink";
    return NULL;
}

nvmlReturn_t nvmlDeviceGetFieldValues(fake_gpu *dev, int count, nvmlFieldValue_t *values) {
    if (count < 0 || (count > 0 && !values)) return NVML_ERROR_INVALID_ARGUMENT;
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, -1, NULL, NULL, &g);
    if (r) return r;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long now_us = (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *f = &values[i];
        int nl, link;
        int k = field_key(f->fieldId, &nl, &link);
        f->timestamp = now_us;
        f->latencyUsec = 0;
        f->value.ullVal = 0;
        if (k >= 0) {
            calls[k]++;
            const char *grp = group_of(k);
            if (in_list(g->unsupported, KEYS[k]) || (grp && in_list(g->unsupported, grp))) {
                f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            } else if (in_list(g->fail, KEYS[k]) || (grp && in_list(g->fail, grp))) {
                f->nvmlReturn = NVML_ERROR_UNKNOWN;
            } else if (k == K_MEMTEMP || k == K_NVLINKS) {
                f->valueType = VT_UINT;
                f->value.uiVal = (unsigned int)g->v[k];
                f->nvmlReturn = NVML_SUCCESS;
            } else {
                f->valueType = VT_ULL;
                f->value.ullVal = (unsigned long long)g->v[k];
                f->nvmlReturn = NVML_SUCCESS;
            }
        } else if (nl >= 0) {
            calls[K_COUNT + nl]++;
            if (link >= g->v[K_NVLINKS] || in_list(g->unsupported, NL_KEYS[nl])
                || in_list(g->unsupported, "nvlink")) {
                f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            } else if (in_list(g->fail, NL_KEYS[nl]) || in_list(g->fail, "nvlink")) {
                f->nvmlReturn = NVML_ERROR_UNKNOWN;
            } else {
                f->valueType = VT_ULL;
                f->value.ullVal = g->nl[nl][link];
                f->nvmlReturn = NVML_SUCCESS;
            }
        } else {
            f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    LEAVE(NVML_SUCCESS);
}

/* ---- events ---- */

nvmlReturn_t nvmlEventSetCreate(fake_event_set **set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof(fake_event_set));
    return *set ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlEventSetFree(fake_event_set *set) {
    free(set);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(fake_gpu *dev, unsigned long long *types) {
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, -1, "events", NULL, &g);
    if (r) return r;
    *types = EVENT_XID;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(fake_gpu *dev, unsigned long long types, fake_event_set *set) {
    fake_gpu *g;
    nvmlReturn_t r = enter(dev, -1, "events", NULL, &g);
    if (r) return r;
    if (!set || (types & ~EVENT_XID)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    set->mask[g->index] |= types;
    LEAVE(NVML_SUCCESS);
}

/* Emit the next scripted XID whose GPU is registered in the set; otherwise sleep in
 * steps of up to 100 ms (watching the config file) until the timeout passes. */
/* Sleep until the config file's directory changes (a test scripting an XID rewrites the
 * file) or ms pass. Like the real driver, which blocks on its device file, an idle wait
 * costs no CPU: the agent's benchmark measures the agent, not wake-ups of this fake. */
static void wait_for_config_change(int watch_fd, long long ms) {
    if (watch_fd < 0) {
        struct timespec nap = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&nap, NULL);
        return;
    }
    struct pollfd pfd = {watch_fd, POLLIN, 0};
    if (poll(&pfd, 1, (int)ms) > 0) {
        char buf[4096];
        while (read(watch_fd, buf, sizeof buf) > 0) {}
    }
}

/* One inotify watch on the config file's directory, kept between waits (setting one up
 * and tearing it down costs ~0.3 ms of kernel time, more than the agent's own work per
 * wait) and made afresh when FAKE_NVML_CONFIG names another file. -1: none. */
static int watch_fd = -1;
static char watched[4096];

static int watch_config_dir(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (!path) return -1;
    pthread_mutex_lock(&lock);
    if (watch_fd >= 0 && strcmp(watched, path) == 0) {
        pthread_mutex_unlock(&lock);
        return watch_fd;
    }
    if (watch_fd >= 0) close(watch_fd);
    watch_fd = -1;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash == dir) slash[1] = '\0';
    else if (slash) *slash = '\0';
    else snprintf(dir, sizeof dir, ".");
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd >= 0 && inotify_add_watch(fd, dir, IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
                                     | IN_MODIFY) < 0) {
        close(fd);
        fd = -1;
    }
    if (fd >= 0) {
        watch_fd = fd;
        snprintf(watched, sizeof watched, "%s", path);
    }
    pthread_mutex_unlock(&lock);
    return fd;
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

nvmlReturn_t nvmlEventSetWait_v2(fake_event_set *set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    /* Watch before the first look at the config, so no change slips in between. */
    int fd = watch_config_dir();
    long long deadline = now_ms() + timeoutms;
    nvmlReturn_t result = NVML_ERROR_TIMEOUT;
    for (;;) {
        pthread_mutex_lock(&lock);
        if (!initialized) {
            result = NVML_ERROR_UNINITIALIZED;
            pthread_mutex_unlock(&lock);
            break;
        }
        reload(0);
        int found = 0;
        while (xid_emitted < cfg.nxid) {
            int i = xid_emitted++;
            int gpu = cfg.xid_gpu[i];
            if (gpu < 0 || gpu >= cfg.count || !(set->mask[gpu] & EVENT_XID)) continue;
            memset(data, 0, sizeof *data);
            data->device = &handles[gpu];
            data->eventType = EVENT_XID;
            data->eventData = cfg.xid_code[i];
            found = 1;
            break;
        }
        pthread_mutex_unlock(&lock);
        if (found) {
            result = NVML_SUCCESS;
            break;
        }
        long long left = deadline - now_ms();
        if (left <= 0) break;
        /* Without a watch (no config file), look again every 100 ms as before. */
        wait_for_config_change(fd, fd < 0 && left > 100 ? 100 : left);
    }
    return result;
}
