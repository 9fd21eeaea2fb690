#include "worker/cuda/batch_plan.h"

#include <map>
#include <tuple>

namespace pith::cuda {
namespace {

constexpr uintptr_t kInputBytes = 2;  // bf16

// What the entries of one batched call share but m.
using ShapeKey = std::tuple<bool, bool, int, int, int, int, int, float, float, bool, int>;

ShapeKey KeyOf(const PlanProduct& p, int chunk) {
  return {p.trans_a, p.trans_b, p.n, p.k, p.lda, p.ldb, p.ldc, p.alpha, p.beta, p.c_fp32, chunk};
}

// The chunk rows for m rows: kBatchRows, or the largest halving of it that fits; 0 below
// kMinRows.
int ChunkRows(int m) {
  int chunk = kBatchRows;
  while (chunk > m && chunk > kMinRows) chunk /= 2;
  return chunk <= m ? chunk : 0;
}

// cuBLAS reads a batched call's bf16 operands in 16-byte loads where it can, and cannot
// check pointers that sit on the device: every entry's must be 16-byte aligned.
bool Aligned(uintptr_t address) { return address % 16 == 0; }
bool Aligned(const PlanProduct& p) { return Aligned(p.a) && Aligned(p.b) && Aligned(p.c); }

struct Group {
  std::vector<int> products;  // indices into the plan's input
  BatchedCall full, tail;
};

}  // namespace

PlanProduct RowsOf(const PlanProduct& p, int first, int rows) {
  PlanProduct out = p;
  out.m = rows;
  // Row r of op(A): row r of A as stored, or its column r when transposed.
  out.a = p.a + (p.trans_a ? uintptr_t(first) : uintptr_t(first) * p.lda) * kInputBytes;
  out.c = p.c + uintptr_t(first) * p.ldc * (p.c_fp32 ? 4 : 2);
  return out;
}

BatchPlan PlanBatches(const std::vector<PlanProduct>& products) {
  BatchPlan plan;
  std::map<ShapeKey, Group> groups;
  std::vector<ShapeKey> order;  // groups in first-seen order, so plans are reproducible
  for (int i = 0; i < static_cast<int>(products.size()); ++i) {
    const PlanProduct& p = products[i];
    const int chunk = ChunkRows(p.m);
    // Chunk starts are multiples of 16 rows, so aligned bases keep every full chunk so.
    if (chunk == 0 || !Aligned(p)) {
      plan.single.push_back(p);
      continue;
    }
    const ShapeKey key = KeyOf(p, chunk);
    auto [at, made] = groups.try_emplace(key);
    if (made) order.push_back(key);
    at->second.products.push_back(i);
  }
  auto add = [](BatchedCall& call, const PlanProduct& rows) {
    call.a.push_back(rows.a);
    call.b.push_back(rows.b);
    call.c.push_back(rows.c);
  };
  std::vector<BatchedCall> tails;
  for (const ShapeKey& key : order) {
    Group& g = groups[key];
    if (g.products.size() < 2) {  // a shape of its own: no gain in a batched call
      plan.single.push_back(products[g.products[0]]);
      continue;
    }
    const int chunk = std::get<10>(key);
    g.full.shape = g.tail.shape = products[g.products[0]];
    g.full.shape.m = g.tail.shape.m = chunk;
    for (int i : g.products) {
      const PlanProduct& p = products[i];
      const int whole = p.m / chunk * chunk;
      for (int r = 0; r < whole; r += chunk) add(g.full, RowsOf(p, r, chunk));
      if (whole == p.m) continue;
      const PlanProduct tail = RowsOf(p, p.m - chunk, chunk);
      if (p.beta == 0.0f && Aligned(tail)) {
        add(g.tail, tail);  // overwrites rows the full call wrote
      } else {
        plan.single.push_back(RowsOf(p, whole, p.m - whole));
      }
    }
    plan.calls.push_back(std::move(g.full));
    if (g.tail.count() > 0) tails.push_back(std::move(g.tail));
  }
  for (BatchedCall& t : tails) plan.calls.push_back(std::move(t));
  return plan;
}

}  // namespace pith::cuda
