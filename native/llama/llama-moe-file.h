#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

struct ggml_tensor;
struct llama_file;

// what tells a file's contents changed without reading them: which file it is, its size, and its
// modification and status change times; the change time (not settable, unlike the modification
// time) shows a rewrite in place whose size and modification time were restored. Taken from the
// open descriptor: a file renamed over the path or unlinked leaves the one opened (and mapped) as
// it was, so its bytes are still the model's
struct llama_moe_file_stamp {
    uint64_t dev      = 0;
    uint64_t ino      = 0;
    uint64_t size     = 0;
    int64_t  mtime_ns = 0;
    int64_t  ctime_ns = 0;  // 0 where the platform has none (Windows)
    uint64_t n_links  = 1;  // names left; 0 once unlinked (or replaced by a rename)

    // false when the file cannot be read (on Windows, by its path)
    static bool of(const std::string & path, const llama_file & file, llama_moe_file_stamp & stamp);

    // the losing of its last name changes a file's status, not its bytes
    bool same(const llama_moe_file_stamp & o) const {
        return dev == o.dev && ino == o.ino && size == o.size && mtime_ns == o.mtime_ns &&
               (ctime_ns == o.ctime_ns || (n_links == 0 && o.n_links > 0));
    }
};

// where a tensor of the model is in its files
struct llama_moe_file_offset {
    int32_t file   = -1; // index in llama_moe_model_files
    size_t  offset = 0;
};

// bytes of a model file, and where the model's mapping of that file has them
struct llama_moe_file_range {
    int32_t      file   = -1;
    size_t       offset = 0;
    size_t       size   = 0;
    const void * mapped = nullptr;
};

// the model files that experts are read from: repacked experts' standard layout is only there, and
// experts mapped and unread are read in through them (the RAM tier), or read from them instead of
// faulting the mapping in (a device cache over them). Reads go through the page cache
class llama_moe_model_files {
public:
    llama_moe_model_files();
    ~llama_moe_model_files();

    // opens every path (the splits of the model, in order) and finds the tensors in their GGUF headers,
    // checked against the loaded ones (type, size, within the file); throws std::runtime_error
    std::map<std::string, llama_moe_file_offset> open(const std::vector<std::string> & paths, const std::vector<const ggml_tensor *> & tensors);
    void clear();

    // every file is still the one opened, unchanged
    bool unchanged() const;

    // size bytes at offset of file, into buf (one reader at a time: the upload worker); nullptr when
    // the file changed around the read; throws when the read fails
    const void * read(int32_t file, size_t offset, size_t size, std::vector<uint8_t> & buf);

    // the ranges not in memory already, read through the page cache all at once (a few threads, each
    // its own requests) and mapped; n_bytes counts them. false when a read failed or a file changed
    bool read_in(const std::vector<llama_moe_file_range> & ranges, size_t & n_bytes) const;

    // unmap the range's pages (those it shares with its neighbours stay) and release it from the page cache
    void drop(const llama_moe_file_range & range) const;

    // release bytes of a file from the page cache; release_all: the whole of every file
    void release(int32_t file, size_t offset, size_t size) const;
    void release_all() const;

private:
    struct model_file;

    std::vector<model_file> files;
};

// whether every page of [data, data + size) is in memory
bool llama_moe_resident(const void * data, size_t size);

// map the pages of [data, data + size) now, in one call, rather than one fault at a time while a
// matmul runs
void llama_moe_populate(const void * data, size_t size);

// a read on a thread of its own, joined later: the RAM tier reads the next layer's experts ahead, and
// a layer's misses while its resident experts are computed
class llama_moe_read_thread {
public:
    ~llama_moe_read_thread();

    // read(n_bytes) on a new thread: whether it read everything, and the bytes it read
    void start(std::function<bool(size_t & n_bytes)> read);
    bool running() const { return thread.joinable(); }

    // waits for the read (false when none was started); n_bytes, the bytes it read
    bool join(size_t & n_bytes);

private:
    std::thread thread;
    bool        ok    = false;
    size_t      bytes = 0;
};
