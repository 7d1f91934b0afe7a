// Binding helpers: argument structs that Python fills by name.
//
//   args = _C.hybrid.SendArgs(hidden=tensor, row_bytes=2 * H, send_slot=slots, num_tokens=T)
//
// Every field is a keyword; an unknown keyword is a TypeError, a field not given keeps the
// struct's default (null pointers, zeros). Pointer fields take None (null), an int address, or
// any object whose class has a data_ptr() method (a torch tensor), so this module never imports torch.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

// pybind11 types have hidden visibility; so must what holds them.
#pragma GCC visibility push(hidden)

namespace ep {
namespace bind {

namespace py = pybind11;

// A tensor's address through its class's data_ptr, looked up once per class and called unbound:
// a getattr by name plus a bound-method call on every pointer field of every op cost about as
// much host time as the rest of building the struct (an eager op builds several).
inline uintptr_t to_address(py::handle value, const std::string& field) {
  if (value.is_none()) return 0;
  if (PyLong_Check(value.ptr())) return py::cast<uintptr_t>(value);
  // The GIL guards it; classes stay referenced. Never freed: a static map's destructor would drop its
  // references after the interpreter has finalized, at process exit.
  static auto& data_ptr_of_class = *new std::map<PyTypeObject*, py::object>();
  PyTypeObject* cls = Py_TYPE(value.ptr());
  auto found = data_ptr_of_class.find(cls);
  if (found == data_ptr_of_class.end()) {
    py::handle type_object(reinterpret_cast<PyObject*>(cls));
    if (!py::hasattr(type_object, "data_ptr")) {
      throw py::type_error("field '" + field + "' takes None, an int address or a tensor, got " +
                           std::string(py::str(type_object.attr("__name__"))));
    }
    found = data_ptr_of_class.emplace(cls, type_object.attr("data_ptr")).first;
    Py_INCREF(type_object.ptr());  // the map's key must outlive any later instance at that address
  }
  return py::cast<uintptr_t>(found->second(value));
}

template <typename S>
class ArgStruct {
 public:
  ArgStruct(py::module_& m, const char* name, const char* doc)
      : cls_(m, name, doc), setters_(std::make_shared<Setters>()) {
    auto setters = setters_;
    const std::string type_name = name;
    cls_.def(py::init([setters, type_name](py::kwargs kwargs) {
      S s{};
      for (auto item : kwargs) {
        Py_ssize_t size = 0;
        const char* text = PyUnicode_AsUTF8AndSize(item.first.ptr(), &size);  // keywords are str
        if (text == nullptr) throw py::error_already_set();
        const std::string_view key(text, static_cast<size_t>(size));
        auto it = setters->find(key);
        if (it == setters->end()) {
          std::string known;
          for (const auto& entry : *setters) known += (known.empty() ? "" : ", ") + entry.first;
          throw py::type_error(type_name + " has no field '" + std::string(key) + "' (fields: " + known + ")");
        }
        it->second(s, item.second);
      }
      return s;
    }));
  }

  // A device pointer field.
  template <typename T>
  ArgStruct& ptr(const char* name, T* S::*member) {
    const std::string field = name;
    (*setters_)[field] = [member, field](S& s, py::handle v) { s.*member = reinterpret_cast<T*>(to_address(v, field)); };
    cls_.def_property(
        name, [member](const S& s) { return reinterpret_cast<uintptr_t>(s.*member); },
        [member, field](S& s, py::object v) { s.*member = reinterpret_cast<T*>(to_address(v, field)); });
    return *this;
  }

  // A plain value field (int, bool, double, ...). Set by keyword or by assignment, a value of another type
  // is a TypeError naming the field, as for ptr() (pybind's own says "incompatible function arguments", or
  // a RuntimeError, naming nothing).
  template <typename T>
  ArgStruct& val(const char* name, T S::*member) {
    const std::string field = name;
    auto set = [member, field](S& s, py::handle v) {
      try {
        s.*member = py::cast<T>(v);
      } catch (const py::cast_error&) {
        const std::string got = PyLong_Check(v.ptr()) ? std::string(py::str(v)) + " (out of range)"
                                                      : std::string(Py_TYPE(v.ptr())->tp_name);
        throw py::type_error("field '" + field + "' takes a C++ " + py::type_id<T>() + ", got " + got);
      }
    };
    (*setters_)[field] = set;
    cls_.def_property(
        name, [member](const S& s) { return s.*member; }, [set](S& s, py::object v) { set(s, v); });
    return *this;
  }

 private:
  using Setters = std::map<std::string, std::function<void(S&, py::handle)>, std::less<>>;  // find(string_view)
  py::class_<S> cls_;
  std::shared_ptr<Setters> setters_;
};

}  // namespace bind
}  // namespace ep

#pragma GCC visibility pop
