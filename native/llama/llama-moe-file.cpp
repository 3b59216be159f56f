#include "llama-moe-file.h"

#include "llama-impl.h"
#include "llama-mmap.h"

#include "ggml.h"
#include "ggml-cpp.h"
#include "gguf.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

#if !defined(_WIN32)
#include <sys/stat.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
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
        files.push_back(std::move(mf));
    }
    return where;
}

void llama_moe_model_files::clear() {
    files.clear();
}

bool llama_moe_model_files::unchanged() const {
    return std::all_of(files.begin(), files.end(), [](const model_file & f) { return f.unchanged(); });
}

const void * llama_moe_model_files::read(int32_t file, size_t offset, size_t size, std::vector<uint8_t> & buf) {
    auto & f = files[file];
    buf.resize(std::max(buf.size(), size));
    if (!f.unchanged()) {
        return nullptr;
    }
    f.file->seek(offset, SEEK_SET);
    f.file->read_raw(buf.data(), size);
    if (!f.unchanged()) {
        return nullptr;
    }
    return buf.data();
}

#if defined(__linux__)
// pread the ranges, a few threads each its own requests, mapping each range once it is read
static bool moe_pread_all(const std::vector<llama_moe_file_range> & ranges, const std::vector<int> & fds) {
    std::atomic<size_t> next{0};
    std::atomic<bool>   failed{false};
    auto reader = [&]() {
        std::vector<uint8_t> buf;
        for (size_t r; (r = next++) < ranges.size() && !failed; ) {
            const auto & range = ranges[r];
            buf.resize(std::max(buf.size(), range.size));
            for (size_t done = 0; done < range.size; ) {
                const ssize_t n = pread(fds[r], buf.data() + done, range.size - done, (off_t) (range.offset + done));
                if (n <= 0) {
                    failed = true; // an I/O error, or a file shorter than its header says
                    break;
                }
                done += (size_t) n;
            }
            if (!failed) {
                llama_moe_populate(range.mapped, range.size);
            }
        }
    };
    const size_t n_threads = std::min<size_t>(ranges.size(), 8);
    std::vector<std::thread> threads;
    for (size_t t = 1; t < n_threads; ++t) {
        threads.emplace_back(reader);
    }
    reader();
    for (auto & t : threads) {
        t.join();
    }
    return !failed;
}
#endif

bool llama_moe_model_files::read_in(const std::vector<llama_moe_file_range> & ranges, size_t & n_bytes) const {
#if !defined(__linux__)
    GGML_UNUSED(ranges);
    GGML_UNUSED(n_bytes);
    return false;
#else
    std::vector<llama_moe_file_range> todo;
    std::vector<int> fds;
    for (const auto & range : ranges) {
        if (llama_moe_resident(range.mapped, range.size)) {
            continue; // in the page cache already (e.g. the whole file is)
        }
        todo.push_back(range);
        fds.push_back(files[range.file].file->file_id());
        n_bytes += range.size;
    }
    // the files' stamps are checked after the reads (what a changed file put in the page cache is
    // never used: the tier stops)
    bool ok = moe_pread_all(todo, fds);
    for (const auto & f : files) {
        ok = ok && f.unchanged();
    }
    return ok;
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

bool llama_moe_resident(const void * data, size_t size) {
#if !defined(__linux__)
    GGML_UNUSED(data);
    GGML_UNUSED(size);
    return false;
#else
    static const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t first = (uintptr_t) data & ~(page - 1);
    const size_t    len   = (uintptr_t) data + size - first;
    std::vector<unsigned char> in((len + page - 1)/page);
    if (mincore((void *) first, len, in.data()) != 0) {
        return false;
    }
    return std::all_of(in.begin(), in.end(), [](unsigned char c) { return (c & 1) != 0; });
#endif
}

void llama_moe_populate(const void * data, size_t size) {
#if defined(__linux__)
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 // Linux 5.14; older kernels refuse it, and the matmuls fault the pages in
#endif
    static const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t first = (uintptr_t) data & ~(page - 1);
    madvise((void *) first, (uintptr_t) data + size - first, MADV_POPULATE_READ);
#else
    GGML_UNUSED(data);
    GGML_UNUSED(size);
#endif
}

llama_moe_read_thread::~llama_moe_read_thread() {
    if (thread.joinable()) {
        thread.join();
    }
}

void llama_moe_read_thread::start(std::function<bool(size_t & n_bytes)> read) {
    thread = std::thread([this, read = std::move(read)]() {
        bytes = 0;
        ok = read(bytes);
    });
}

bool llama_moe_read_thread::join(size_t & n_bytes) {
    if (!thread.joinable()) {
        return false;
    }
    thread.join();
    n_bytes = bytes;
    return ok;
}
