#include "llama-moe-file.h"

#include "llama-impl.h"
#include "llama-mmap.h"

#include "ggml.h"
#include "ggml-cpp.h"
#include "gguf.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <string>
#include <stdexcept>
#include <tuple>

#if !defined(_WIN32)
#include <sys/stat.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <sys/sysmacros.h>
#include <fcntl.h>
#include <unistd.h>
#endif

bool llama_moe_file_stamp::of(const std::string & path, const llama_file & file, llama_moe_file_stamp & stamp) {
#if defined(_WIN32)
    GGML_UNUSED(file);
    std::error_code ec;
    stamp.size = std::filesystem::file_size(path, ec);
    if (ec) {
        return false;
    }
    stamp.mtime_ns = std::filesystem::last_write_time(path, ec).time_since_epoch().count();
    return !ec;
#else
    GGML_UNUSED(path);
    struct stat st;
    if (fstat(file.file_id(), &st) != 0) {
        return false;
    }
#if defined(__APPLE__)
    const struct timespec mtime = st.st_mtimespec, ctime = st.st_ctimespec;
#else
    const struct timespec mtime = st.st_mtim, ctime = st.st_ctim;
#endif
    stamp.dev      = (uint64_t) st.st_dev;
    stamp.ino      = (uint64_t) st.st_ino;
    stamp.size     = (uint64_t) st.st_size;
    stamp.mtime_ns = (int64_t) mtime.tv_sec * 1000000000 + mtime.tv_nsec;
    stamp.ctime_ns = (int64_t) ctime.tv_sec * 1000000000 + ctime.tv_nsec;
    stamp.n_links  = (uint64_t) st.st_nlink;
    return true;
#endif
}

// a model file that experts are read from
struct llama_moe_model_files::model_file {
    std::string                 path;
    std::unique_ptr<llama_file> file;
    llama_moe_file_stamp        stamp; // when it was opened

    // the file at path is still the one opened, unchanged
    bool unchanged() const {
        llama_moe_file_stamp now;
        return llama_moe_file_stamp::of(path, *file, now) && now.same(stamp);
    }
};

#if defined(__linux__)
// the largest request readahead(2) takes whole on the device holding fd: the kernel cuts one at the
// larger of the device's readahead and its largest request (read_ahead_kb, max_sectors_kb); 128 KiB
// where sysfs does not say (the kernel's default readahead)
static size_t moe_readahead_max(int fd) {
    size_t best = 128*1024;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        return best;
    }
    const std::string dev = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
    for (const char * queue : { "/queue/", "/../queue/" }) { // a disk, or a partition of one
        for (const char * name : { "read_ahead_kb", "max_sectors_kb" }) {
            FILE * f = fopen((dev + queue + name).c_str(), "r");
            unsigned long kb = 0;
            if (f && fscanf(f, "%lu", &kb) == 1) {
                best = std::max(best, (size_t) kb*1024);
            }
            if (f) {
                fclose(f);
            }
        }
    }
    return best;
}

// the huge page the faults of a mapping advised MADV_HUGEPAGE read as one folio; 0: none
static size_t moe_huge_page() {
    size_t n = 0;
    if (FILE * f = fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r")) {
        if (fscanf(f, "%zu", &n) != 1 || (n & (n - 1)) != 0) {
            n = 0;
        }
        fclose(f);
    }
    return n;
}
#endif

llama_moe_model_files::llama_moe_model_files() = default;
llama_moe_model_files::~llama_moe_model_files() = default;

std::map<std::string, llama_moe_file_offset> llama_moe_model_files::open(const std::vector<std::string> & paths,
                                                                         const std::vector<const ggml_tensor *> & tensors) {
    std::map<std::string, llama_moe_file_offset> where;
    for (const auto & path : paths) {
        model_file mf;
        mf.path  = std::filesystem::absolute(path).string(); // checked later, whatever the working directory
        mf.file  = std::make_unique<llama_file>(path.c_str(), "rb");
#if defined(__linux__)
        // no readahead on this descriptor: a read brings in exactly its pages, as small folios that the
        // RAM tier can release again (a large folio across two experts' ranges is never released)
        posix_fadvise(mf.file->file_id(), 0, 0, POSIX_FADV_RANDOM);
#endif
        if (!llama_moe_file_stamp::of(mf.path, *mf.file, mf.stamp)) {
            throw std::runtime_error(format("cannot stat %s", path.c_str()));
        }
        gguf_context_ptr gguf(gguf_init_from_file(path.c_str(), { /*.no_alloc =*/ true, /*.ctx =*/ nullptr }));
        if (!gguf) {
            throw std::runtime_error(format("%s is not a readable GGUF file", path.c_str()));
        }
        for (const ggml_tensor * t : tensors) {
            const int64_t id = gguf_find_tensor(gguf.get(), ggml_get_name(t));
            if (id < 0) {
                continue;
            }
            const size_t offset = gguf_get_data_offset(gguf.get()) + gguf_get_tensor_offset(gguf.get(), id);
            if (gguf_get_tensor_type(gguf.get(), id) != t->type || gguf_get_tensor_size(gguf.get(), id) != ggml_nbytes(t) ||
                    offset + ggml_nbytes(t) > mf.stamp.size) {
                throw std::runtime_error(format("%s in %s does not match the loaded model", ggml_get_name(t), path.c_str()));
            }
            where[ggml_get_name(t)] = { (int32_t) files.size(), offset };
        }
#if defined(__linux__)
        ra_max.push_back(moe_readahead_max(mf.file->file_id()));
#else
        ra_max.push_back(0);
#endif
        huge.push_back(0);
        files.push_back(std::move(mf));
    }
    return where;
}

void llama_moe_model_files::clear() {
    files.clear();
    ra_max.clear();
    huge.clear();
}

bool llama_moe_model_files::unchanged() const {
    return std::all_of(files.begin(), files.end(), [](const model_file & f) { return f.unchanged(); });
}

const void * llama_moe_model_files::read(int32_t file, size_t offset, size_t size, void * dst) {
    auto & f = files[file];
    if (!f.unchanged()) {
        return nullptr;
    }
    f.file->seek(offset, SEEK_SET);
    f.file->read_raw(dst, size);
    if (!f.unchanged()) {
        return nullptr;
    }
    return dst;
}

void llama_moe_model_files::advise_huge(const std::vector<llama_moe_file_range> & tensors) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const size_t page = moe_huge_page();
    if (page == 0) {
        return;
    }
    std::vector<bool> ok(files.size(), true);
    for (const auto & t : tensors) {
        const uintptr_t beg = (uintptr_t) t.mapped;
        const uintptr_t first = (beg + page - 1) & ~(page - 1), last = (beg + t.size) & ~(page - 1);
        ok[t.file] = ok[t.file] && (beg - t.offset) % page == 0 &&
                     (last <= first || madvise((void *) first, last - first, MADV_HUGEPAGE) == 0);
    }
    for (size_t f = 0; f < files.size(); ++f) {
        huge[f] = ok[f] ? page : 0;
    }
#else
    GGML_UNUSED(tensors);
#endif
}

void llama_moe_model_files::split_huge(std::vector<llama_moe_file_range> & ranges) const {
    std::vector<llama_moe_file_range> pieces;
    pieces.reserve(ranges.size());
    for (const auto & r : ranges) {
        const size_t page = huge[r.file];
        const size_t end  = r.offset + r.size;
        const size_t lo   = page ? (r.offset + page - 1)/page*page : 0, hi = page ? end/page*page : 0;
        if (hi <= lo) {
            pieces.push_back(r);
            continue;
        }
        for (auto [beg, to, is_huge] : { std::make_tuple(r.offset, lo, false), std::make_tuple(lo, hi, true), std::make_tuple(hi, end, false) }) {
            if (to > beg) {
                pieces.push_back({ r.file, beg, to - beg, (const char *) r.mapped + (beg - r.offset), is_huge });
            }
        }
    }
    ranges.swap(pieces);
}

size_t llama_moe_model_files::missing(const llama_moe_file_range & range) const {
#if !defined(__linux__)
    return range.size;
#else
    static const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t first = (uintptr_t) range.mapped & ~(page - 1);
    const size_t    len   = (uintptr_t) range.mapped + range.size - first;
    std::vector<unsigned char> in((len + page - 1)/page);
    if (mincore((void *) first, len, in.data()) != 0) {
        return range.size;
    }
    const size_t n_in = std::count_if(in.begin(), in.end(), [](unsigned char c) { return (c & 1) != 0; });
    return std::min(range.size, (in.size() - n_in)*page);
#endif
}

void llama_moe_model_files::start(const llama_moe_file_range & range) const {
#if defined(__linux__)
    if (range.huge) {
        return; // (readahead(2) would add small folios)
    }
    const int    fd   = files[range.file].file->file_id();
    const size_t step = ra_max[range.file];
    for (size_t done = 0; done < range.size; done += step) {
        readahead(fd, (off_t) (range.offset + done), std::min(step, range.size - done));
    }
#else
    GGML_UNUSED(range);
#endif
}

bool llama_moe_model_files::map(const llama_moe_file_range & range) const {
    return llama_moe_populate(range.mapped, range.size);
}

bool llama_moe_model_files::read_in(const std::vector<llama_moe_file_range> & ranges, size_t & n_bytes) const {
#if !defined(__linux__)
    GGML_UNUSED(ranges);
    GGML_UNUSED(n_bytes);
    return false;
#else
    std::vector<llama_moe_file_range> todo;
    for (const auto & range : ranges) {
        const size_t n = missing(range);
        if (n > 0) { // else in the page cache already (e.g. the whole file is)
            todo.push_back(range);
            n_bytes += n;
        }
    }
    split_huge(todo);
    for (const auto & range : todo) {
        start(range);
    }
    bool ok = true;
    for (const auto & range : todo) {
        ok = map(range) && ok;
    }
    // the files' stamps are checked after the reads (what a changed file put in the page cache is
    // never used: the tier stops)
    return ok && unchanged();
#endif
}

void llama_moe_model_files::drop(const llama_moe_file_range & range) const {
#if !defined(__linux__)
    GGML_UNUSED(range);
#else
    static const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t beg = (uintptr_t) range.mapped;
    const uintptr_t end = beg + range.size;
    const uintptr_t first = (beg + page - 1) & ~(page - 1), last = end & ~(page - 1);
    if (last > first) {
        madvise((void *) first, last - first, MADV_DONTNEED);
    }
    release(range.file, range.offset, range.size);
#endif
}

void llama_moe_model_files::release(int32_t file, size_t offset, size_t size) const {
#if defined(__linux__)
    posix_fadvise(files[file].file->file_id(), (off_t) offset, (off_t) size, POSIX_FADV_DONTNEED);
#else
    GGML_UNUSED(file);
    GGML_UNUSED(offset);
    GGML_UNUSED(size);
#endif
}

void llama_moe_model_files::release_all() const {
    for (int32_t f = 0; f < (int32_t) files.size(); ++f) {
        release(f, 0, 0);
    }
}

bool llama_moe_populate(const void * data, size_t size) {
#if defined(__linux__)
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 // Linux 5.14; older kernels refuse it, and the matmuls fault the pages in
#endif
    static const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t first = (uintptr_t) data & ~(page - 1);
    for (;;) {
        if (madvise((void *) first, (uintptr_t) data + size - first, MADV_POPULATE_READ) == 0) {
            return true;
        }
        if (errno != EINTR && errno != EAGAIN) {
            return errno == EINVAL; // EFAULT: a page that cannot be read (past the end of a file cut short, an I/O error)
        }
    }
#else
    GGML_UNUSED(data);
    GGML_UNUSED(size);
    return true;
#endif
}
