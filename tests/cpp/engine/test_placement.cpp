// place_models: resident on the device with the most room, only where every model that may spill there keeps
// room for its working set; otherwise spilled on every device.
#include "device_engine_helpers.h"
#include "engine/placement.h"

namespace engine_test {
namespace {

using hydra::engine::place_models;

std::vector<DeviceEngine*> pointers(std::vector<std::unique_ptr<DeviceEngine>>& engines) {
  std::vector<DeviceEngine*> out;
  for (auto& e : engines) out.push_back(e.get());
  return out;
}

TEST(Placement, ResidentOnTheDeviceWithTheMostRoomSpilledEverywhereOtherwise) {
  auto small = equal_shards(2, 16), large = equal_shards(3, 64);
  const int64_t need = DeviceEngine::resident_need(*small) + DeviceEngine::spilled_need(*large);
  std::vector<std::unique_ptr<DeviceEngine>> engines;
  engines.push_back(std::make_unique<DeviceEngine>(kCpu, need));
  engines.push_back(std::make_unique<DeviceEngine>(kCpu, need + 4096));  // more room: the resident one goes here
  const auto placed = place_models(pointers(engines), {small, large}, {"small", "large"});
  ASSERT_EQ(placed.size(), 2u);
  EXPECT_EQ(placed[0].resident_device, 1);
  EXPECT_EQ(placed[0].model_ids, (std::vector<int>{-1, 0}));
  EXPECT_TRUE(engines[1]->resident(0));
  // large's whole state does not fit beside small's: spilled, on both devices.
  EXPECT_EQ(placed[1].resident_device, -1);
  EXPECT_EQ(placed[1].model_ids, (std::vector<int>{0, 1}));
  EXPECT_FALSE(engines[0]->resident(0));
  EXPECT_FALSE(engines[1]->resident(1));
}

TEST(Placement, AnEarlyResidentModelNeverLeavesALaterOneWithoutRoom) {
  auto small = equal_shards(2, 16), large = equal_shards(2, 256);
  const int64_t resident = DeviceEngine::resident_need(*small), spilled = DeviceEngine::spilled_need(*large);
  const int64_t budget = std::max(resident, spilled) + 4096;
  ASSERT_GT(resident + spilled, budget) << "small resident would leave large no room";
  std::vector<std::unique_ptr<DeviceEngine>> engines;
  engines.push_back(std::make_unique<DeviceEngine>(kCpu, budget));
  const auto placed = place_models(pointers(engines), {small, large}, {"small", "large"});
  EXPECT_EQ(placed[0].resident_device, -1);
  EXPECT_EQ(placed[1].resident_device, -1);
}

TEST(Placement, AModelThatCannotTrainIsNamed) {
  auto fits = equal_shards(2, 16), huge = equal_shards(2, 4096);
  std::vector<std::unique_ptr<DeviceEngine>> engines;
  engines.push_back(std::make_unique<DeviceEngine>(kCpu, DeviceEngine::spilled_need(*fits) + 4096));
  try {
    place_models(pointers(engines), {fits, huge}, {"fits", "huge"});
    FAIL() << "a model whose largest shard exceeds the budget was placed";
  } catch (const c10::Error& error) {
    const std::string message = error.what_without_backtrace();
    EXPECT_NE(message.find("task 'huge': memory budget too small"), std::string::npos) << message;
  }
  EXPECT_THROW(place_models(pointers(engines), {fits}, {}), c10::Error) << "one name per store";
}

TEST(Placement, AddingAsResidentWhatDoesNotFitIsRefusedAndChangesNothing) {
  auto store = equal_shards(2, 64);
  DeviceEngine engine(kCpu, DeviceEngine::spilled_need(*store) + 4096);
  EXPECT_THROW(engine.add_model(store, DeviceEngine::Residency::kResident), c10::Error);
  EXPECT_EQ(engine.free_bytes(), DeviceEngine::spilled_need(*store) + 4096);
  EXPECT_EQ(engine.add_model(store), 0) << "the refused call registered nothing";
  EXPECT_FALSE(engine.resident(0));
}

TEST(Placement, AResidentModelsGraphMustFitBesideItsStateAndIsKeptOutsideTheArena) {
  auto store = equal_shards(2, 64);
  const int64_t resident = DeviceEngine::resident_need(*store), budget = 4 * resident;
  {  // a graph that fits beside the state: resident, and the arena's budget gives the graph its room
    std::vector<std::unique_ptr<DeviceEngine>> engines;
    engines.push_back(std::make_unique<DeviceEngine>(kCpu, budget));
    engines[0]->expect_arrivals();  // the arena would take the whole budget
    const auto placed = place_models(pointers(engines), {store}, {"fits"}, {2 * resident});
    EXPECT_EQ(placed[0].resident_device, 0);
    EXPECT_EQ(engines[0]->free_bytes(), budget - 3 * resident);
    EXPECT_EQ(engines[0]->stats().capacity_bytes, budget - 2 * resident) << "the arena left the graph its room";
  }
  {  // one that does not: spilled, and nothing is kept outside the arena
    std::vector<std::unique_ptr<DeviceEngine>> engines;
    engines.push_back(std::make_unique<DeviceEngine>(kCpu, budget));
    const auto placed = place_models(pointers(engines), {store}, {"too big a graph"}, {3 * resident + 1});
    EXPECT_EQ(placed[0].resident_device, -1);
    EXPECT_EQ(engines[0]->free_bytes(), budget - DeviceEngine::spilled_need(*store));
  }
  std::vector<std::unique_ptr<DeviceEngine>> engines;
  engines.push_back(std::make_unique<DeviceEngine>(kCpu, budget));
  EXPECT_THROW(place_models(pointers(engines), {store}, {"x"}, {1, 2}), c10::Error) << "one graph per store";
  EXPECT_THROW(place_models(pointers(engines), {store}, {"x"}, {-1}), c10::Error);
}

TEST(Placement, KeepingMoreOutsideTheArenaThanTheBudgetHasLeftIsRefusedAndChangesNothing) {
  auto store = equal_shards(2, 64);
  DeviceEngine engine(kCpu, 4 * DeviceEngine::resident_need(*store));
  const int64_t free = engine.free_bytes();
  EXPECT_THROW(engine.keep_outside_arena(free + 1), c10::Error);
  EXPECT_THROW(engine.keep_outside_arena(-1), c10::Error);
  EXPECT_EQ(engine.free_bytes(), free);
  engine.keep_outside_arena(free / 2);
  EXPECT_EQ(engine.free_bytes(), free - free / 2);
}

}  // namespace
}  // namespace engine_test
