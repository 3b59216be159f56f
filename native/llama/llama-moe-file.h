#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
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
    bool         huge   = false; // whole huge pages inside one expert's part (split_huge): read by map()'s faults
};

// the model files that experts are read from: repacked experts' standard layout is only there, and
// experts mapped and unread are read into the page cache through them and mapped (the RAM tier), or read from them instead of
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

    // size bytes at offset of file, into dst (one reader at a time: the upload worker); nullptr when
    // the file changed around the read; throws when the read fails
    const void * read(int32_t file, size_t offset, size_t size, void * dst);

    // the bytes of range not in the page cache
    size_t missing(const llama_moe_file_range & range) const;

    // have the faults in the experts' mapping read each huge page (2 MiB on x86-64) as one large folio
    // (MADV_HUGEPAGE): the page cache adds, maps and releases one folio where it handled 512 pages.
    // tensors: every expert tensor read through the mapping. A file whose mapping is not aligned as
    // the file is, or a kernel that refuses, keeps small pages
    void advise_huge(const std::vector<llama_moe_file_range> & tensors);

    // each range (one expert's part) as its head, the whole huge pages inside it (huge: left to map()'s
    // faults, one large folio each, never shared with another expert, so a drop releases it) and its
    // tail, where its file was advised huge
    void split_huge(std::vector<llama_moe_file_range> & ranges) const;

    // start reading range into the page cache, without a copy (readahead(2), in requests of at most
    // what the file's device reads ahead at once: a larger one would be cut there; a huge range is left
    // to map()); map(range): wait for its pages and map them (MADV_POPULATE_READ) rather than one fault
    // at a time while a matmul runs; false when a page cannot be read (an I/O error, a file cut short)
    void start(const llama_moe_file_range & range) const;
    bool map  (const llama_moe_file_range & range) const;

    // the ranges not in memory already, all started, then mapped (n_bytes counts them); false when a
    // read failed or a file changed
    bool read_in(const std::vector<llama_moe_file_range> & ranges, size_t & n_bytes) const;

    // unmap the range's pages (those it shares with its neighbours stay) and release it from the page cache
    void drop(const llama_moe_file_range & range) const;

    // release bytes of a file from the page cache; release_all: the whole of every file
    void release(int32_t file, size_t offset, size_t size) const;
    void release_all() const;

private:
    struct model_file;

    std::vector<model_file> files;
    std::vector<size_t>     ra_max; // [file] the largest request readahead(2) takes whole there
    std::vector<size_t>     huge;   // [file] the huge page its experts are read in (advise_huge); 0: small pages
};

// map the pages of [data, data + size) now, in one call, rather than one fault at a time while a
// matmul runs; false when a page cannot be read (a kernel without MADV_POPULATE_READ: true, the
// matmul faults them in)
bool llama_moe_populate(const void * data, size_t size);
