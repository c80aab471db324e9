/*
 * c_generate: greedy decoding of a loopcast artifact through the ONNX Runtime C API.
 *
 *   c_generate ARTIFACT_DIR MAX_NEW_TOKENS ID,ID,...
 *
 * Reads manifest.json (cJSON), opens the prefill and decode graphs, registers the custom-op
 * library when the manifest names one, allocates every KV slot once and binds it as both
 * past and present (GroupQueryAttention updates it in place), then prints the generated ids
 * comma-separated. Errors print one "error: ..." line and exit 2.
 *
 * Lengths contract (manifest kv_layout): M new rows at positions n..n+M-1 take
 * seqlens_k = n+M-1 (int32 [1]) and total_sequence_length = n+M (int32 scalar).
 */
#define _DEFAULT_SOURCE  /* realpath */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>
#include <limits.h>

#include <cjson/cJSON.h>
#include <onnxruntime_c_api.h>

static const OrtApi *ort;

static void die(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fputs("error: ", stderr);
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
    exit(2);
}

static void check(OrtStatus *status, const char *what) {
    if (status != NULL) {
        const char *msg = ort->GetErrorMessage(status);
        /* ORT messages can span lines; keep the first so the error stays one line. */
        char first[512];
        snprintf(first, sizeof first, "%s", msg);
        first[strcspn(first, "\n")] = '\0';
        ort->ReleaseStatus(status);
        die("%s: %s", what, first);
    }
}

#define MANIFEST_MAX_BYTES (16L << 20)  /* as loopcast/confined_files.py */
#define GRAPH_MAX_BYTES (2047L << 20)

/* A regular file opened for reading: O_NONBLOCK so that a FIFO cannot block the open, then
 * fstat on the descriptor (what was opened is what is checked; docs/trust.md, "Files"). */
static int open_regular(const char *path, struct stat *st) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) die("%s: not found or unreadable", path);
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) die("%s: not a regular file; refusing it", path);
    return fd;
}

/* The whole file, at most max_size bytes (refused above it, before anything is read). */
static char *read_file(const char *path, long max_size, long *out_size) {
    struct stat st;
    int fd = open_regular(path, &st);
    if (st.st_size > max_size)
        die("%s: %lld bytes, more than the %ld read for it; refusing it", path, (long long)st.st_size, max_size);
    size_t size = (size_t)st.st_size, got = 0;
    char *text = malloc(size + 1);
    if (text == NULL) die("%s: cannot read", path);
    while (got < size) {
        ssize_t n = read(fd, text + got, size - got);
        if (n <= 0) die("%s: cannot read", path);
        got += (size_t)n;
    }
    close(fd);
    text[size] = '\0';
    if (out_size != NULL) *out_size = (long)size;
    return text;
}

/* ---- SHA-256 (FIPS 180-4), for the trust rule: the op library must match the manifest. ---- */
typedef struct {
    uint32_t h[8];
    uint64_t length;
    unsigned char block[64];
    size_t used;
} Sha256;

static const uint32_t SHA_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(Sha256 *s, const unsigned char *p) {
    uint32_t w[64], v[8];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(v, s->h, sizeof v);
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = v[7] + (ROR(v[4], 6) ^ ROR(v[4], 11) ^ ROR(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) +
                      SHA_K[i] + w[i];
        uint32_t t2 = (ROR(v[0], 2) ^ ROR(v[0], 13) ^ ROR(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
        memmove(v + 1, v, 7 * sizeof *v);
        v[4] += t1;
        v[0] = t1 + t2;
    }
    for (int i = 0; i < 8; i++) s->h[i] += v[i];
}

static void sha256_update(Sha256 *s, const unsigned char *data, size_t n) {
    s->length += n;
    while (n > 0) {
        size_t take = 64 - s->used < n ? 64 - s->used : n;
        memcpy(s->block + s->used, data, take);
        s->used += take, data += take, n -= take;
        if (s->used == 64) sha256_block(s, s->block), s->used = 0;
    }
}

/* Hex digest of a whole file into out[65]. */
static void sha256_file(const char *path, char out[65]) {
    Sha256 s = {{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19},
                0, {0}, 0};
    struct stat st;
    FILE *f = fdopen(open_regular(path, &st), "rb");
    if (f == NULL) die("%s: cannot read", path);
    unsigned char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) sha256_update(&s, buf, n);
    fclose(f);
    uint64_t bits = s.length * 8;
    unsigned char pad = 0x80, zero = 0, len[8];
    sha256_update(&s, &pad, 1);
    while (s.used != 56) sha256_update(&s, &zero, 1);
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)(bits >> (56 - 8 * i));
    sha256_update(&s, len, 8);
    for (int i = 0; i < 8; i++) snprintf(out + 8 * i, 9, "%08x", s.h[i]);
}

/* ---- Manifest: every value range-checked, every path confined (docs/trust.md). ---- */
static const cJSON *field(const cJSON *obj, const char *name, const char *manifest) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (item == NULL) die("%s: corrupt manifest (missing field '%s')", manifest, name);
    return item;
}

/* An integral JSON number in [lo, hi]; anything else is a corrupt manifest, never a crash. */
static double number_in(const cJSON *item, const char *name, double lo, double hi, const char *manifest) {
    /* Range first: casting an out-of-range double to an integer type is undefined. */
    if (!cJSON_IsNumber(item) || !(item->valuedouble >= lo && item->valuedouble <= hi) ||
        item->valuedouble != (double)(int64_t)item->valuedouble)
        die("%s: corrupt manifest (%s must be an integer in %.0f..%.0f)", manifest, name, lo, hi);
    return item->valuedouble;
}

static int int_in(const cJSON *item, const char *name, long lo, long hi, const char *manifest) {
    return (int)number_in(item, name, (double)lo, (double)hi, manifest);
}

static int int_field(const cJSON *obj, const char *name, long lo, long hi, const char *manifest) {
    return int_in(field(obj, name, manifest), name, lo, hi, manifest);
}

#define MAX_SLOTS 4096
#define MAX_DIM 65536
#define MAX_LENGTH (1 << 24)
#define MAX_VOCAB (1 << 24)

typedef struct {
    int slots, kv_heads, max_length, head_dim, vocab;
    int uses_custom_ops;
    char dir[PATH_MAX], prefill_path[PATH_MAX], decode_path[PATH_MAX], custom_ops[PATH_MAX];
    char custom_ops_sha256[65];
    int eos[64], n_eos;
} Manifest;

/* dir/name, refusing names that could leave the artifact: empty, absolute, "..", a component
 * of "." or "", and (after resolving symlinks) anything outside the real artifact directory. */
static void confined_path(const Manifest *m, const char *name, const char *what, const char *manifest,
                          char *out, size_t size) {
    if (name[0] == '\0' || name[0] == '/' || strstr(name, "//") != NULL || strchr(name, '\\') != NULL)
        die("%s: %s '%s' must be a relative path inside the artifact", manifest, what, name);
    const char *part = name;
    while (part != NULL) {
        size_t len = strcspn(part, "/");
        if ((len == 2 && strncmp(part, "..", 2) == 0) || (len == 1 && part[0] == '.') || len == 0)
            die("%s: %s '%s' must be a relative path inside the artifact (no '..')", manifest, what, name);
        part = part[len] == '/' ? part + len + 1 : NULL;
    }
    if ((size_t)snprintf(out, size, "%s/%s", m->dir, name) >= size) die("%s: %s path too long", manifest, what);
    char real[PATH_MAX];
    if (realpath(out, real) == NULL) die("%s: %s is missing", out, what);
    size_t n = strlen(m->dir);
    if (strncmp(real, m->dir, n) != 0 || real[n] != '/')
        die("%s: %s resolves outside the artifact directory (to %s); refusing it", out, what, real);
    struct stat st;
    if (stat(real, &st) != 0 || !S_ISREG(st.st_mode)) die("%s: %s is not a regular file", out, what);
    snprintf(out, size, "%s", real);  /* open what was checked */
}

/* The recorded size of a file (manifest "files"), checked like the Python loader does. */
static const cJSON *file_record(const cJSON *root, const char *name) {
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(root, "files");
    return cJSON_IsObject(files) ? cJSON_GetObjectItemCaseSensitive(files, name) : NULL;
}

static void check_size(const cJSON *root, const char *name, const char *path, const char *what,
                       const char *manifest) {
    const cJSON *record = file_record(root, name);
    if (record == NULL) return;
    if (!cJSON_IsObject(record)) die("%s: corrupt manifest (files['%s'])", manifest, name);
    double want = number_in(field(record, "size", manifest), "size", 0, 9007199254740992.0, manifest);
    struct stat st;
    if (stat(path, &st) != 0 || (double)st.st_size != want)
        die("%s: %s has %lld bytes, the manifest records %.0f (truncated or replaced; re-export the artifact)",
            path, what, (long long)st.st_size, want);
}

static void graph_path(const cJSON *root, const cJSON *graphs, const char *kind, Manifest *m,
                       const char *manifest, char *out, size_t size) {
    const cJSON *graph = cJSON_GetObjectItemCaseSensitive(graphs, kind);
    if (graph == NULL) die("%s: corrupt manifest (no '%s' graph)", manifest, kind);
    const cJSON *file = field(graph, "file", manifest);
    if (!cJSON_IsString(file)) die("%s: corrupt manifest (graphs.%s.file)", manifest, kind);
    char what[64];
    snprintf(what, sizeof what, "graph file for '%s'", kind);
    confined_path(m, file->valuestring, what, manifest, out, size);
    check_size(root, file->valuestring, out, what, manifest);
    /* Every slot this program binds must be one the graph has. */
    const cJSON *slots = field(graph, "kv_slots", manifest), *slot;
    if (!cJSON_IsArray(slots) || cJSON_GetArraySize(slots) != m->slots)
        die("%s: corrupt manifest (graphs.%s.kv_slots must list all %d slots)", manifest, kind, m->slots);
    cJSON_ArrayForEach(slot, slots) int_in(slot, "kv_slots[]", 0, m->slots - 1, manifest);
}

/* Whether an ONNX model's main graph has a node of the "loopcast" domain: a minimal protobuf walk
 * (ModelProto.graph = 7, GraphProto.node = 1, NodeProto.domain = 7). 0/1, or -1 if malformed. */
static int read_varint(const unsigned char *p, size_t end, size_t *pos, uint64_t *value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*pos >= end) return -1;
        unsigned char byte = p[(*pos)++];
        *value |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) return 0;
    }
    return -1;
}

static int has_domain(const unsigned char *p, size_t start, size_t end, const int *path, int depth) {
    size_t pos = start;
    while (pos < end) {
        uint64_t key, value;
        if (read_varint(p, end, &pos, &key) != 0) return -1;
        int number = (int)(key >> 3), wire = (int)(key & 7);
        if (wire == 0) {
            if (read_varint(p, end, &pos, &value) != 0) return -1;
        } else if (wire == 1 || wire == 5) {
            pos += wire == 1 ? 8 : 4;
        } else if (wire == 2) {
            if (read_varint(p, end, &pos, &value) != 0 || value > end - pos) return -1;
            if (number == path[0]) {
                if (depth == 1) {
                    if (value == 8 && memcmp(p + pos, "loopcast", 8) == 0) return 1;
                } else {
                    int found = has_domain(p, pos, pos + (size_t)value, path + 1, depth - 1);
                    if (found != 0) return found;
                }
            }
            pos += (size_t)value;
        } else {
            return -1;
        }
        if (pos > end) return -1;
    }
    return 0;
}

static int uses_loopcast_domain(const char *graph_file) {
    long size;
    unsigned char *bytes = (unsigned char *)read_file(graph_file, GRAPH_MAX_BYTES, &size);
    static const int path[3] = {7, 1, 7};
    int found = has_domain(bytes, 0, (size_t)size, path, 3);
    free(bytes);
    if (found < 0) die("%s: not a readable ONNX model", graph_file);
    return found;
}

/* Whether the user built a library of this hash (loopcast/ops_trust.py writes the registry). */
static int locally_built(const char *sha256) {
    char path[PATH_MAX];
    const char *cache = getenv("LOOPCAST_CACHE"), *home = getenv("HOME");
    if (cache != NULL && cache[0] != '\0') snprintf(path, sizeof path, "%s/trusted-ops.sha256", cache);
    else if (home != NULL) snprintf(path, sizeof path, "%s/.cache/loopcast/trusted-ops.sha256", home);
    else return 0;
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    char line[PATH_MAX + 80];
    int found = 0;
    while (!found && fgets(line, sizeof line, f) != NULL)
        found = strncmp(line, sha256, 64) == 0 && (line[64] == ' ' || line[64] == '\n' || line[64] == '\0');
    fclose(f);
    return found;
}

static Manifest read_manifest(const char *dir, int trust_ops) {
    Manifest m = {0};
    if (realpath(dir, m.dir) == NULL) die("%s: artifact directory not found", dir);
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/manifest.json", m.dir);
    /* confined like every file it names: a symlink leaving the artifact, a FIFO or an
     * oversized manifest is refused before it is read */
    struct stat link;
    if (lstat(path, &link) != 0) die("%s: not found (not an exported artifact?)", path);
    confined_path(&m, "manifest.json", "manifest", path, path, sizeof path);
    char *text = read_file(path, MANIFEST_MAX_BYTES, NULL);
    cJSON *root = cJSON_Parse(text);
    if (root == NULL || !cJSON_IsObject(root)) die("%s: corrupt manifest (not valid JSON)", path);
    const cJSON *version = field(root, "schema_version", path);
    if (!cJSON_IsNumber(version) || version->valuedouble != 6)
        die("%s: manifest schema version %g, this program reads version 6; re-export the artifact", path,
            cJSON_IsNumber(version) ? version->valuedouble : -1.0);
    const cJSON *dtype = field(root, "dtype", path);
    if (!cJSON_IsString(dtype) || strcmp(dtype->valuestring, "fp32") != 0)
        die("%s: dtype %s is not supported here (fp32 artifacts only)", path,
            cJSON_IsString(dtype) ? dtype->valuestring : "?");
    m.max_length = int_field(root, "max_length", 1, MAX_LENGTH, path);
    const cJSON *model = field(root, "model", path);
    if (!cJSON_IsObject(model)) die("%s: corrupt manifest (model)", path);
    m.vocab = int_field(model, "vocab_size", 1, MAX_VOCAB, path);
    const cJSON *kv = field(root, "kv_layout", path);
    if (!cJSON_IsObject(kv)) die("%s: corrupt manifest (kv_layout)", path);
    m.slots = int_field(kv, "slots", 1, MAX_SLOTS, path);
    const cJSON *shape = field(kv, "shape", path);
    if (!cJSON_IsArray(shape) || cJSON_GetArraySize(shape) != 4) die("%s: corrupt manifest (kv_layout.shape)", path);
    int_in(cJSON_GetArrayItem(shape, 0), "kv_layout.shape[0]", 1, 1, path);
    m.kv_heads = int_in(cJSON_GetArrayItem(shape, 1), "kv_layout.shape[1]", 1, MAX_DIM, path);
    int_in(cJSON_GetArrayItem(shape, 2), "kv_layout.shape[2] (= max_length)", m.max_length, m.max_length, path);
    m.head_dim = int_in(cJSON_GetArrayItem(shape, 3), "kv_layout.shape[3]", 1, MAX_DIM, path);
    const cJSON *graphs = field(root, "graphs", path);
    if (!cJSON_IsObject(graphs)) die("%s: corrupt manifest (graphs)", path);
    graph_path(root, graphs, "prefill", &m, path, m.prefill_path, sizeof m.prefill_path);
    graph_path(root, graphs, "decode", &m, path, m.decode_path, sizeof m.decode_path);
    const cJSON *weights = field(root, "weights_file", path);
    if (!cJSON_IsString(weights)) die("%s: corrupt manifest (weights_file)", path);
    char weights_path[PATH_MAX];
    confined_path(&m, weights->valuestring, "weights file", path, weights_path, sizeof weights_path);
    check_size(root, weights->valuestring, weights_path, "weights file", path);

    /* The op library: loaded only when the graphs need it, from a regular file inside the
     * artifact whose SHA-256 matches the manifest, and only when trusted (docs/trust.md). */
    const cJSON *lib = cJSON_GetObjectItemCaseSensitive(root, "custom_op_library");
    const cJSON *ops = cJSON_GetObjectItemCaseSensitive(root, "custom_ops");
    if (lib != NULL && !cJSON_IsNull(lib) && !cJSON_IsString(lib)) die("%s: corrupt manifest (custom_op_library)", path);
    int listed = cJSON_IsArray(ops) && cJSON_GetArraySize(ops) > 0;
    if (cJSON_IsString(lib) && listed &&
        (uses_loopcast_domain(m.prefill_path) || uses_loopcast_domain(m.decode_path))) {
        if (strchr(lib->valuestring, '/') != NULL)
            die("%s: custom_op_library must be a plain file name inside the artifact", path);
        confined_path(&m, lib->valuestring, "custom-op library", path, m.custom_ops, sizeof m.custom_ops);
        const cJSON *record = file_record(root, lib->valuestring);
        const cJSON *digest = cJSON_IsObject(record) ? cJSON_GetObjectItemCaseSensitive(record, "sha256") : NULL;
        if (!cJSON_IsString(digest) || strlen(digest->valuestring) != 64)
            die("%s: the manifest records no SHA-256 for the custom-op library, so it is not loaded", m.custom_ops);
        sha256_file(m.custom_ops, m.custom_ops_sha256);
        if (strcmp(m.custom_ops_sha256, digest->valuestring) != 0)
            die("%s: custom-op library SHA-256 does not match the manifest; not loading it", m.custom_ops);
        if (!trust_ops && !locally_built(m.custom_ops_sha256))
            die("%s: the graphs need this native custom-op library, which is not one you built (loopcast "
                "build-ops); loading it runs its code. Pass --trust-ops only if you trust whoever made this artifact",
                m.custom_ops);
        m.uses_custom_ops = 1;
    }
    const cJSON *eos = cJSON_GetObjectItemCaseSensitive(root, "eos_token_ids");
    if (eos != NULL && !cJSON_IsArray(eos)) die("%s: corrupt manifest (eos_token_ids must be a list)", path);
    const cJSON *id;
    cJSON_ArrayForEach(id, eos) {
        int value = int_in(id, "eos_token_ids[]", 0, m.vocab - 1, path);
        if (m.n_eos < 64) m.eos[m.n_eos++] = value;
    }
    /* The KV buffers are allocated before any graph checks them: bound their size first. */
    double kv_bytes = 2.0 * m.slots * m.kv_heads * (double)m.max_length * m.head_dim * sizeof(float);
    if (kv_bytes > (double)SIZE_MAX / 2 || kv_bytes > 1e12)
        die("%s: corrupt manifest (KV buffers of %.0f bytes)", path, kv_bytes);
    cJSON_Delete(root);
    free(text);
    return m;
}

typedef struct {
    OrtSession *session;
    OrtIoBinding *binding;
} Graph;

static OrtValue *tensor(OrtMemoryInfo *mem, void *data, size_t bytes, const int64_t *shape, size_t rank,
                        ONNXTensorElementDataType type) {
    OrtValue *value = NULL;
    check(ort->CreateTensorWithDataAsOrtValue(mem, data, bytes, shape, rank, type, &value), "tensor");
    return value;
}

/* Bind every slot's K and V buffer as past and present of one graph. */
static void bind_kv(Graph *g, OrtValue **keys, OrtValue **values, int slots) {
    char name[64];
    for (int s = 0; s < slots; s++) {
        snprintf(name, sizeof name, "past_key.%d", s);
        check(ort->BindInput(g->binding, name, keys[s]), name);
        snprintf(name, sizeof name, "past_value.%d", s);
        check(ort->BindInput(g->binding, name, values[s]), name);
        snprintf(name, sizeof name, "present_key.%d", s);
        check(ort->BindOutput(g->binding, name, keys[s]), name);
        snprintf(name, sizeof name, "present_value.%d", s);
        check(ort->BindOutput(g->binding, name, values[s]), name);
    }
}

static int is_eos(const Manifest *m, int64_t token) {
    for (int i = 0; i < m->n_eos; i++)
        if (m->eos[i] == token) return 1;
    return 0;
}

int main(int argc, char **argv) {
    int trust_ops = argc > 1 && strcmp(argv[1], "--trust-ops") == 0;
    argv += trust_ops;
    argc -= trust_ops;
    if (argc != 4) die("usage: c_generate [--trust-ops] ARTIFACT_DIR MAX_NEW_TOKENS ID,ID,...");
    ort = OrtGetApiBase()->GetApi(ORT_API_VERSION);
    if (ort == NULL) die("the ONNX Runtime library does not provide C API version %d", ORT_API_VERSION);
    Manifest m = read_manifest(argv[1], trust_ops);
    char *end = NULL;
    long max_new = strtol(argv[2], &end, 10);
    if (*end != '\0' || max_new < 0) die("MAX_NEW_TOKENS must be an integer >= 0, got '%s'", argv[2]);

    /* prompt ids */
    int64_t *prompt = malloc(sizeof(int64_t) * (strlen(argv[3]) + 1));
    if (prompt == NULL) die("out of memory");
    int64_t n_prompt = 0;
    for (char *tok = strtok(argv[3], ","); tok != NULL; tok = strtok(NULL, ",")) {
        long id = strtol(tok, &end, 10);
        if (*end != '\0') die("prompt ids must be comma-separated integers, got '%s'", tok);
        if (id < 0 || id >= m.vocab) die("token id %ld is outside the vocabulary [0, %d)", id, m.vocab);
        prompt[n_prompt++] = id;
    }
    if (n_prompt == 0) die("prompt is empty: give at least one token");
    if (n_prompt > m.max_length) die("prompt of %lld tokens is longer than the max length %d",
                                     (long long)n_prompt, m.max_length);

    OrtEnv *env;
    check(ort->CreateEnv(ORT_LOGGING_LEVEL_ERROR, "c_generate", &env), "CreateEnv");
    OrtSessionOptions *options;
    check(ort->CreateSessionOptions(&options), "CreateSessionOptions");
    check(ort->SetSessionGraphOptimizationLevel(options, ORT_ENABLE_ALL), "optimization level");
    check(ort->AddSessionConfigEntry(options, "session.intra_op.allow_spinning", "0"), "spinning");
    if (m.uses_custom_ops) check(ort->RegisterCustomOpsLibrary_V2(options, m.custom_ops), m.custom_ops);
    Graph prefill = {0}, decode = {0};
    check(ort->CreateSession(env, m.prefill_path, options, &prefill.session), m.prefill_path);
    check(ort->CreateSession(env, m.decode_path, options, &decode.session), m.decode_path);
    check(ort->CreateIoBinding(prefill.session, &prefill.binding), "binding");
    check(ort->CreateIoBinding(decode.session, &decode.binding), "binding");

    OrtMemoryInfo *mem;
    check(ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &mem), "memory info");

    /* KV: one K and one V buffer per slot, allocated once, bound to both graphs. */
    const int64_t kv_shape[4] = {1, m.kv_heads, m.max_length, m.head_dim};
    size_t kv_floats = (size_t)m.kv_heads * m.max_length * m.head_dim;
    OrtValue **keys = calloc((size_t)m.slots, sizeof *keys), **values = calloc((size_t)m.slots, sizeof *values);
    float *kv_data = calloc(kv_floats * 2 * (size_t)m.slots, sizeof(float));
    if (kv_data == NULL) die("cannot allocate %zu bytes of KV", kv_floats * 2 * m.slots * sizeof(float));
    for (int s = 0; s < m.slots; s++) {
        keys[s] = tensor(mem, kv_data + (2 * s) * kv_floats, kv_floats * sizeof(float), kv_shape, 4,
                         ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
        values[s] = tensor(mem, kv_data + (2 * s + 1) * kv_floats, kv_floats * sizeof(float), kv_shape, 4,
                           ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    }
    bind_kv(&prefill, keys, values, m.slots);
    bind_kv(&decode, keys, values, m.slots);

    /* Step inputs and outputs: fixed buffers, bound once (prefill rebinds only its ids). */
    int64_t token_in[1], next_id[1];
    int32_t seqlens[1], total[1];
    float *logits = malloc(sizeof(float) * (size_t)m.vocab);
    if (logits == NULL || keys == NULL || values == NULL) die("out of memory");
    const int64_t one[1] = {1}, ids_shape[2] = {1, 1}, logits_shape[3] = {1, 1, m.vocab};
    OrtValue *seqlens_v = tensor(mem, seqlens, sizeof seqlens, one, 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
    OrtValue *total_v = tensor(mem, total, sizeof total, NULL, 0, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
    OrtValue *next_v = tensor(mem, next_id, sizeof next_id, ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    OrtValue *logits_v = tensor(mem, logits, sizeof(float) * (size_t)m.vocab, logits_shape, 3,
                                ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    OrtValue *token_v = tensor(mem, token_in, sizeof token_in, ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    const int64_t prompt_shape[2] = {1, n_prompt};
    OrtValue *prompt_v = tensor(mem, prompt, sizeof(int64_t) * (size_t)n_prompt, prompt_shape, 2,
                                ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    Graph *graphs[2] = {&prefill, &decode};
    for (int i = 0; i < 2; i++) {
        check(ort->BindInput(graphs[i]->binding, "seqlens_k", seqlens_v), "seqlens_k");
        check(ort->BindInput(graphs[i]->binding, "total_sequence_length", total_v), "total_sequence_length");
        check(ort->BindOutput(graphs[i]->binding, "next_token_ids_BS", next_v), "next_token_ids_BS");
        check(ort->BindOutput(graphs[i]->binding, "logits_BSV", logits_v), "logits_BSV");
    }
    check(ort->BindInput(prefill.binding, "input_ids_BS", prompt_v), "input_ids_BS");
    check(ort->BindInput(decode.binding, "input_ids_BS", token_v), "input_ids_BS");
    OrtRunOptions *run;
    check(ort->CreateRunOptions(&run), "run options");

    /* Greedy: prefill the prompt, then one decode step per token. n = committed KV length. */
    int64_t n = 0;
    long produced = 0;
    if (max_new > 0) {
        seqlens[0] = (int32_t)(n_prompt - 1);
        total[0] = (int32_t)n_prompt;
        check(ort->RunWithBinding(prefill.session, run, prefill.binding), "prefill");
        n = n_prompt;
        for (;;) {
            int64_t token = next_id[0];
            printf(produced ? ",%lld" : "%lld", (long long)token);
            produced++;
            if (is_eos(&m, token) || produced >= max_new || n >= m.max_length) break;
            token_in[0] = token;
            seqlens[0] = (int32_t)n;
            total[0] = (int32_t)(n + 1);
            check(ort->RunWithBinding(decode.session, run, decode.binding), "decode");
            n += 1;
        }
    }
    printf("\n");

    ort->ReleaseRunOptions(run);
    OrtValue *all[] = {seqlens_v, total_v, next_v, logits_v, token_v, prompt_v};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) ort->ReleaseValue(all[i]);
    for (int s = 0; s < m.slots; s++) {
        ort->ReleaseValue(keys[s]);
        ort->ReleaseValue(values[s]);
    }
    for (int i = 0; i < 2; i++) {
        ort->ReleaseIoBinding(graphs[i]->binding);
        ort->ReleaseSession(graphs[i]->session);
    }
    ort->ReleaseMemoryInfo(mem);
    ort->ReleaseSessionOptions(options);
    ort->ReleaseEnv(env);
    free(kv_data);
    free(keys);
    free(values);
    free(logits);
    free(prompt);
    return 0;
}
